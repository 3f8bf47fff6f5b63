"""Rollout and evaluate on 2 processes (gloo) give exactly the 1-process artifacts; a failing process fails the
stage on every process with one error naming its rank, and nothing is written (stages.common.distributed)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from schemas.errors import SmdInputError, SmdRankError
from schemas.params.compaction import CompactionParams
from schemas.raw_masks import read_raw_masks
from schemas.tables import write_table
from stages.compaction import run_compaction
from stages.evaluate.stage import run_evaluate
from stages.learner.train import run_learner
from stages.rollout.stage import run_rollout
from tests.helpers import make_model_dir, make_params, random_prompts

# 3 prompts x 3 responses = 9 jobs in 5 batches of 2: rank 0 samples batches 0, 2, 4 and rank 1 batches 1, 3;
# two shards per process (shard_rows 2).
OVER = {"rollout.group_size": 3, "rollout.batch_size": 2, "rollout.shard_rows": 2, "evaluate.batch_size": 2,
        "evaluate.max_new_tokens": 5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, scenarios: list[tuple], report: Path) -> None:
    """One pair of processes runs every scenario in turn (a process start costs more than a tiny stage)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import stages.rollout.stage as rollout_stage

    for name, stage, args, fail_rank in scenarios:
        if rank == fail_rank:
            def broken(*a, **k):
                raise RuntimeError("injected failure")

            rollout_stage.generate_batch = broken  # this process only: its sampling raises mid-stage
        fn = {"rollout": run_rollout, "evaluate": run_evaluate}[stage]
        try:
            fn(make_params(**OVER), 1, *args, show_progress=False)
            outcome = {"ok": True}
        except SmdRankError as exc:
            outcome = {"ok": False, "message": str(exc), "exit_code": exc.exit_code}
        (report / f"{name}-rank{rank}.json").write_text(json.dumps(outcome))
    torch.distributed.destroy_process_group()


def outcomes(report: Path, name: str) -> list[dict]:
    return [json.loads((report / f"{name}-rank{r}.json").read_text()) for r in range(2)]


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model_dir = make_model_dir(root, "gqa")
    rows = [{"prompt_id": f"p{i}", "task": "kv_retrieval", "prompt": "x", "prompt_token_ids": ids,
             "reference": "cat"} for i, ids in enumerate(random_prompts([30, 45, 38, 33, 41], seed=1))]
    return root, model_dir, write_table(rows, root / "prompts.arrow", "prompts")


@pytest.fixture(scope="module")
def two_processes(inputs):
    """Rollout, evaluate, and a rollout whose rank 1 raises, on 2 processes (~35 s for the three)."""
    root, model_dir, prompts = inputs
    report = root / "report"
    report.mkdir()
    scenarios = [("rollout", "rollout", (model_dir, prompts, root / "two"), -1),
                 ("evaluate", "evaluate", (model_dir, prompts, root / "eval-two"), -1),
                 ("failed", "rollout", (model_dir, prompts, root / "failed" / "rollout"), 1)]
    mp.spawn(_worker, args=(2, free_port(), scenarios, report), nprocs=2, join=True)
    return report


@pytest.mark.slow
def test_rollout_two_processes_equal_one(inputs, two_processes):
    """~15 s more: byte-identical trajectory table and compacted masks, and the learner's parity gate passes."""
    root, model_dir, prompts = inputs
    one = run_rollout(make_params(**OVER), 1, model_dir, prompts, root / "one", show_progress=False)
    assert outcomes(two_processes, "rollout") == [{"ok": True}, {"ok": True}]
    two = root / "two"
    assert (two / "trajectories.arrow").read_bytes() == one["trajectories"].read_bytes()
    _, shards = read_raw_masks(two / "masks.raw.zarr")
    assert [s["mask_row"].tolist() for s in shards] == [[0, 1], [4, 5], [8], [2, 3], [6, 7]]  # rank 0's, rank 1's
    assert not (two / ".parts").exists()
    metrics = json.loads((two / "details.json").read_text())
    assert metrics["rollout/processes"] == 2 and metrics["rollout/trajectories"] == 9
    packed = [run_compaction(CompactionParams(chunk_rows=2), d / "trajectories.arrow", d / "masks.raw.zarr",
                      d.parent / f"{d.name}-compact" / "masks.zarr")["masks"] for d in (root / "one", two)]
    assert tree_bytes(packed[0]) == tree_bytes(packed[1])
    # the shadow masks written by two processes replay the sampler (learn refuses otherwise)
    run_learner(make_params(**OVER, **{"learner.num_threads": 1}), 1, model_dir, two / "trajectories.arrow", packed[1],
          root / "policy")
    parity = json.loads((root / "learn" / "details.json").read_text())
    assert parity["mismatch/logprob_abs_diff_max"] <= 1e-5


@pytest.mark.slow
def test_evaluate_two_processes_equal_one(inputs, two_processes):
    """~5 s more: the same predictions table and figures (only wall times differ)."""
    root, model_dir, prompts = inputs
    one = run_evaluate(make_params(**OVER), 1, model_dir, prompts, root / "eval-one", show_progress=False)
    assert outcomes(two_processes, "evaluate") == [{"ok": True}] * 2
    assert (root / "eval-two" / "predictions.arrow").read_bytes() == one["predictions"].read_bytes()
    a, b = (json.loads((d / "details.json").read_text()) for d in (root / "eval-one", root / "eval-two"))
    timing = ("seconds", "tokens_per_s", "processes")
    assert {k: v for k, v in a.items() if not k.endswith(timing)} == {k: v for k, v in b.items() if not k.endswith(timing)}
    assert a["eval/dense/reference_nll"] == b["eval/dense/reference_nll"]  # summed in the same order
    assert b["eval/processes"] == 2


@pytest.mark.slow
def test_failing_process_fails_every_process_and_writes_nothing(inputs, two_processes):
    """Rank 1's sampling raises; both processes raise the same one-line error, no output, no temporary."""
    root, _, _ = inputs
    out = root / "failed" / "rollout"
    for outcome in outcomes(two_processes, "failed"):
        assert not outcome["ok"] and outcome["exit_code"] == 1
        assert outcome["message"].startswith("rank 1 of 2 failed: RuntimeError: injected failure")
        assert "\n" not in outcome["message"]
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # the temporary directory is gone too


def test_launcher_argv(tmp_path):
    from cli.launch import check_hostfile, launcher_argv

    with pytest.raises(SmdInputError, match=r"params.yaml: pipeline.hostfile: .*hosts is not a file"):
        check_hostfile(Path("params.yaml"), str(tmp_path / "hosts"))
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    check_hostfile(Path("params.yaml"), str(tmp_path / "hosts"))

    cmd = ["rollout", "-i", "1", "--params", "params.yaml"]
    assert launcher_argv(1, None, cmd, "smdctl", "deepspeed", 1234) == ["smdctl", *cmd]
    assert launcher_argv(2, None, cmd, "smdctl", "deepspeed", 1234) == [
        "deepspeed", "--num_gpus", "2", "--master_port", "1234", "--no_local_rank", "smdctl", *cmd]
    assert launcher_argv(1, "hosts", cmd, "smdctl", "deepspeed", None) == [
        "deepspeed", "--hostfile", "hosts", "--num_gpus", "1", "--no_local_rank", "smdctl", *cmd]


@pytest.mark.slow
def test_launch_two_processes_reports_one_line(inputs, tmp_path):
    """~25 s: `smdctl launch` with pipeline.processes=2 runs the deepspeed launcher; bad input read by every
    process gives one error line (rank 0's), exit code 2, nothing written."""
    import subprocess
    import sys

    root, model_dir, prompts = inputs
    smdctl = Path(sys.executable).parent / "smdctl"
    params = tmp_path / "params.yaml"
    params.write_text("pipeline:\n  processes: 2\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    run = subprocess.run([str(smdctl), "launch", "evaluate", "-i", "1", "--policy", str(tmp_path / "nope"),
                          "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--no-progress", "-p", str(params)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2
    errors = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("error:")]
    assert errors == [f"error: rank 0 of 2 failed: {tmp_path / 'nope'}: no policy checkpoint (config.json missing)"]
    assert not (tmp_path / "out").exists()
