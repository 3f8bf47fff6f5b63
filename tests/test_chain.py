"""`smdctl chain`: the iteration chain in one process writes the stages' artifact layout and resumes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from schemas.params import load_params
from schemas.tables import read_table
from stages.rollout.stage import run_rollout
from tests.helpers import empty_params, make_model_dir, write_prompt_splits

SETS = ["rollout.prompts_per_iteration=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "rollout.batch_size=4",
        "rollout.eviction.window=4", "rollout.eviction.sinks=2", "learner.micro_batch_size=4",
        "evaluate.max_new_tokens=4", "evaluate.batch_size=4"]


@pytest.mark.slow
def test_chain_writes_the_pipeline_layout_and_resumes(tmp_path):
    model_dir = make_model_dir(tmp_path, "gqa")
    (model_dir.parent / "metrics.json").write_text(json.dumps({"schema_version": "1", "reward": 0.25}))  # warm start's
    data = write_prompt_splits(tmp_path / "data")
    run = tmp_path / "run"
    args = ["chain", "--run-dir", str(run), "--params", str(empty_params(tmp_path)), "--warmstart", str(model_dir),
            "--data", str(data), *[x for s in SETS for x in ("-S", s)]]
    res = CliRunner().invoke(app, [*args, "--iterations", "2"])
    assert res.exit_code == 0, res.output
    art = run / "artifacts"
    for n in (1, 2):
        base = art / f"iter-{n:03d}"
        for path in ("rollout/trajectories.arrow", "compact/masks.zarr", "learn/metrics.json", "policy/config.json",
                     "evaluate/metrics.json", "progress.json"):
            assert (base / path).exists(), path
    assert [r["iteration"] for r in json.loads((art / "iter-002" / "progress.json").read_text())["rows"]] == [1, 2]
    assert not (art / "iter-001" / "policy" / "trainer_state").exists()  # only the newest keeps optimizer state
    assert (art / "iter-002" / "policy" / "trainer_state").exists()
    # iteration 2 sampled with iteration 1's policy, exactly as the rollout stage does alone
    p = load_params(None, SETS)
    again = run_rollout(p, 2, art / "iter-001" / "policy", data / "train.arrow", tmp_path / "again", show_progress=False)
    assert read_table(again["trajectories"], "trajectories").equals(
        read_table(art / "iter-002" / "rollout" / "trajectories.arrow", "trajectories"))

    # Extending the chain runs only the new iteration; earlier outputs stay untouched.
    before = {f: f.stat().st_mtime_ns for f in (art / "iter-001").rglob("*") if f.is_file()}
    res = CliRunner().invoke(app, [*args, "--iterations", "3"])
    assert res.exit_code == 0, res.output
    assert {f: f.stat().st_mtime_ns for f in before} == before
    assert (art / "iter-003" / "evaluate" / "metrics.json").exists()
    headline = json.loads((art / "metrics.json").read_text())  # follows the last iteration, as dvc repro's
    last = json.loads((art / "iter-003" / "progress.json").read_text())["rows"][-1]
    assert headline["iteration"] == 3 and headline["warm_dense"] == 0.25
    assert headline["reward"] == last["reward/mean"] and headline["dense"] == last["eval/dense/score"]
    assert "learner" in (run / "params.yaml").read_text()
