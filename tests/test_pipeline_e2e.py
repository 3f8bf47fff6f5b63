"""End to end: the whole DAG with `dvc repro` on a micro configuration, in a temporary project copy.

Checks every artifact against its schema, that learner parity held in smd mode, that a second
`dvc repro` does nothing, that a learner-only parameter change reruns learn (not rollout) of the same
iteration, and that a run killed inside learn@2 resumes with earlier outputs untouched.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from schemas.compacted_masks import open_mask_store, read_mask_rows
from schemas.tables import read_table
from tests.helpers import make_project, run_ok, subprocess_env


def _wait_for_process(session: int, words: list[str], timeout: float = 120.0) -> None:
    """Until a process of `session` has all of `words` in its command line (read from /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if os.getsid(int(entry.name)) == session and all(w.encode() in argv for w in words):
                    return
            except (OSError, ProcessLookupError):
                continue
        time.sleep(0.05)
    raise AssertionError(f"no process {' '.join(words)} in session {session} within {timeout}s")


@pytest.mark.slow
def test_dvc_pipeline_end_to_end(tmp_path):
    proj = make_project(tmp_path)
    art = proj / "artifacts"

    # Kill the run (SIGKILL) inside learn@2, then resume. DVC's output is buffered (its "Running stage" line may come
    # only after the stage ran), so learn@2 is found by its own process, polled in /proc from the start, and
    # interrupted while it is still starting (imports, DeepSpeed).
    log_path = tmp_path / "repro.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(["dvc", "repro"], cwd=proj, env=subprocess_env(), stdout=log_file, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            _wait_for_process(proc.pid, ["learn", "--iteration", "2"], timeout=900)
            time.sleep(0.5)
            # SIGKILL of the whole run: in the full suite a SIGINT here did not stop learn@2 (it still wrote its
            # policy); a hard kill leaves nothing to chance and is the harsher fault to resume from.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    log = log_path.read_text()
    assert "Running stage 'learn@2'" in log, log[-3000:]
    assert not (art / "iter-002" / "policy").exists()
    before = {p: p.stat().st_mtime_ns for p in (art / "iter-001" / "rollout").rglob("*") if p.is_file()}
    out = run_ok(["dvc", "repro"], proj)
    assert "Running stage 'rollout@1'" not in out and "Running stage 'learn@1'" not in out
    assert {p: p.stat().st_mtime_ns for p in before} == before

    # Every artifact against its contract.
    for split in ("train", "eval"):
        read_table(art / "data" / f"{split}.arrow", "prompts")
    for it in ("001", "002"):
        traj = read_table(art / f"iter-{it}" / "rollout" / "trajectories.arrow", "trajectories")
        store = art / f"iter-{it}" / "compact" / "masks.zarr"
        open_mask_store(store)
        rows = read_mask_rows(store, list(range(traj.num_rows)))
        lengths = [len(a) + len(b) for a, b in zip(traj.column("prompt_token_ids").to_pylist(),
                                                     traj.column("response_token_ids").to_pylist())]
        assert [r.shape[0] for r in rows] == lengths
        learn = json.loads((art / f"iter-{it}" / "learn" / "metrics.json").read_text())
        assert learn["mismatch/logprob_abs_diff_max"] <= 1e-5  # smd parity held before the first step
        assert (art / f"iter-{it}" / "policy" / "config.json").exists()
        read_table(art / f"iter-{it}" / "evaluate" / "predictions.arrow", "eval_predictions")
        assert json.loads((art / f"iter-{it}" / "progress.json").read_text())["rows"][-1]["iteration"] == int(it)

    # Nothing to do the second time but the reward-files record (`always_changed`: DVC cannot see a user's reward
    # file), whose unchanged output reruns nothing after it.
    status = run_ok(["dvc", "status"], proj)
    assert re.fullmatch(r"reward-files:\s+always changed", status.strip()), status
    out = run_ok(["dvc", "repro"], proj)
    assert re.findall(r"Running stage '([^']+)'", out) == ["reward-files"], out[-2000:]

    # A learner-only change touches learn@1 and what follows, not rollout@1.
    params = yaml.safe_load((proj / "params.yaml").read_text())
    params["learner"]["lr"] = params["learner"]["lr"] * 2
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = run_ok(["dvc", "status"], proj)
    assert "learn@1:" in status and "rollout@1:" not in status and "compact@1:" not in status
