"""The default experiment's headline: artifacts/metrics.json is dvc.yaml's one DVC metric, it holds the last
progress row's figures under short keys (and the warm start's dense score), `dvc metrics show` prints it in
160 columns, and bad input is one line naming the file and field."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from schemas.errors import SmdInputError
from schemas.layout import METRICS, RunLayout
from schemas.params import check_iterations_file, iterations_yaml
from stages.progress.headline import HEADLINE_KEYS, WARMSTART_KEY, headline_record, run_headline
from stages.progress.stage import HEADLINE, PROGRESS_KIND

ROOT = Path(__file__).resolve().parents[1]


def _stages() -> dict[str, dict]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: stage.get("do", stage) for name, stage in stages.items()}


def _paths(entries: list) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries]


def test_the_only_dvc_metric_is_the_headline_file():
    metrics = [p for stage in _stages().values() for p in _paths(stage.get("metrics", []))]
    assert metrics == [RunLayout().headline.as_posix()] == ["artifacts/metrics.json"]
    stage = _stages()["headline"]
    assert stage["cmd"] == "smdctl headline --iteration ${last.n}"
    assert "artifacts/iter-${last.id}/progress.json" in stage["deps"]
    assert (RunLayout().warmstart / METRICS).as_posix() in stage["deps"]
    # the per-stage metrics files stay, as uncached outs
    for name, path in (("rollout", "artifacts/iter-${item.id}/rollout/metrics.json"),
                       ("learn", "artifacts/iter-${item.id}/learn/metrics.json"),
                       ("evaluate", "artifacts/iter-${item.id}/evaluate/metrics.json"),
                       ("warmstart", "artifacts/warmstart/metrics.json")):
        entry = next(e for e in _stages()[name]["outs"] if isinstance(e, dict) and path in e)
        assert entry[path] == {"cache": False}
    # git keeps the headline (DVC experiments commit it; every other artifact is ignored)
    assert "!/artifacts/metrics.json" in (ROOT / ".gitignore").read_text().splitlines()


def test_headline_keys_are_progress_row_keys():
    for _, stage, key in HEADLINE_KEYS[1:]:
        assert key in HEADLINE[stage], key


def _progress(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": 1, "kind": PROGRESS_KIND,
                                "config": {"iteration": rows[-1]["iteration"]}, "rows": rows}))


def _row(n: int) -> dict:
    row = {"iteration": n, "rollout/tokens_per_s": 99.0 + n, "grad_norm": 1.5}
    for i, (_, _, key) in enumerate(HEADLINE_KEYS[1:]):
        row[key] = round(0.01 * (i + 1) + n, 6)
    return row


def test_headline_equals_the_last_progress_row(tmp_path):
    run = RunLayout(tmp_path / "artifacts")
    rows = [_row(1), _row(2), _row(3)]
    _progress(run.iteration(3).progress, rows)
    run.warmstart.mkdir(parents=True)
    (run.warmstart / METRICS).write_text(json.dumps({"reward": 0.69, "exact_match": 0.34, "schema_version": 1}))

    out = run_headline(3, run.iteration(3).progress, run.warmstart / METRICS, run.headline)
    assert out == run.headline
    got = json.loads(out.read_text())
    assert list(got) == [k for k, _, _ in HEADLINE_KEYS] + [WARMSTART_KEY[0]]  # flat, in order
    assert {k: got[k] for k, _, _ in HEADLINE_KEYS} == {k: rows[-1][pk] for k, _, pk in HEADLINE_KEYS}
    assert got["warm_dense"] == 0.69
    assert not any(p.name.startswith(".") for p in run.artifacts.iterdir())  # atomic: no temporary left

    # a key the row lacks is left out (DVC shows "-"); the CLI writes the same file
    del rows[-1]["mismatch/kl"]
    _progress(run.iteration(3).progress, rows)
    from cli.main import app

    res = CliRunner().invoke(app, ["headline", "--iteration", "3", "--artifacts", str(run.artifacts)])
    assert res.exit_code == 0, res.output
    got = json.loads(run.headline.read_text())
    assert "mismatch_kl" not in got and got["dlogp_max"] == rows[-1]["mismatch/logprob_abs_diff_max"]


def test_headline_follows_the_progress_stage(tmp_path):
    """Through `run_progress` on per-stage metrics files: the headline is its last row."""
    pytest.importorskip("tensorboard")
    from stages.progress.stage import run_progress

    run = RunLayout(tmp_path)
    run.warmstart.mkdir(parents=True)
    (run.warmstart / METRICS).write_text(json.dumps({"reward": 0.5}))
    for n in (1, 2):
        it = run.iteration(n)
        for stage, keys in HEADLINE.items():
            it.stage(stage).mkdir(parents=True)
            (it.stage(stage) / METRICS).write_text(json.dumps({k: n + i / 100 for i, k in enumerate(keys)}))
    progress = run_progress(2, tmp_path)
    row = json.loads(progress.read_text())["rows"][-1]
    got = json.loads(run_headline(2, progress, run.warmstart / METRICS, run.headline).read_text())
    assert got == {**{k: row[pk] for k, _, pk in HEADLINE_KEYS}, "warm_dense": 0.5}


@pytest.mark.parametrize("content, match", [
    (None, r"iter-002/progress.json: missing \(run `smdctl progress --iteration 2` first\)"),
    ("{not json", r"iter-002/progress.json: not valid JSON"),
    ("[1, 2]", r"iter-002/progress.json: expected a JSON object, found a list"),
    ({"kind": "other", "rows": []}, r"progress.json: kind: expected 'progress', found 'other'"),
    ({"kind": "progress", "rows": []}, r"progress.json: rows: expected a non-empty list"),
    ({"kind": "progress", "rows": [{"iteration": 1}]}, r"progress.json: rows\[-1\].iteration: is 1, expected 2"),
    ({"kind": "progress", "rows": [{"iteration": 2, "eval/dense/score": "high"}]},
     r"progress.json: rows\[-1\].eval/dense/score: expected a number, found 'high'"),
])
def test_bad_progress_is_one_line_naming_file_and_field(tmp_path, content, match):
    run = RunLayout(tmp_path)
    path = run.iteration(2).progress
    path.parent.mkdir(parents=True)
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    run.warmstart.mkdir(parents=True)
    (run.warmstart / METRICS).write_text(json.dumps({"reward": 0.5}))
    with pytest.raises(SmdInputError, match=match):
        run_headline(2, path, run.warmstart / METRICS, run.headline)
    assert not run.headline.exists()


def test_bad_warmstart_and_the_cli_line(tmp_path):
    with pytest.raises(SmdInputError, match=r"w.json: reward: expected a number, found None"):
        headline_record({"iteration": 1}, {"reward": None}, warm_source="w.json")
    from cli.main import app

    res = CliRunner().invoke(app, ["headline", "-i", "4", "--artifacts", str(tmp_path)])
    assert res.exit_code == 2
    assert "iter-004/progress.json: missing" in res.output and len(res.output.strip().splitlines()) == 1


def test_iterations_file_names_the_last_iteration(tmp_path):
    path = tmp_path / "iterations.yaml"
    path.write_text(iterations_yaml(3))
    assert yaml.safe_load(path.read_text())["last"] == {"n": 3, "id": "003"}
    tree = yaml.safe_load(path.read_text())
    tree["last"] = {"n": 2, "id": "002"}
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(SmdInputError, match=r"iterations.yaml: last: is .*expected .*run `smdctl iterations`"):
        check_iterations_file(path, 3)


@pytest.mark.skipif(shutil.which("dvc", path=os.path.dirname(sys.executable)) is None, reason="needs dvc")
def test_dvc_metrics_show_fits_160_columns(tmp_path):
    """`dvc metrics show` on dvc.yaml with a headline of wide values (negative, 5 decimals) is one row <= 160."""
    for name in ("dvc.yaml", "iterations.yaml", "params.yaml"):
        shutil.copy(ROOT / name, tmp_path / name)
    dvc = os.path.join(os.path.dirname(sys.executable), "dvc")
    subprocess.run([dvc, "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    wide = {k: (120 if k == "iteration" else -0.123456789) for k, _, _ in HEADLINE_KEYS}
    record = headline_record({pk: wide[k] for k, _, pk in HEADLINE_KEYS}, {"reward": -0.123456789})
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "metrics.json").write_text(json.dumps(record))
    out = subprocess.run([dvc, "metrics", "show"], cwd=tmp_path, check=True, capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "400"}).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("artifacts/metrics.json"), out
    assert max(len(line) for line in lines) <= 160, out
