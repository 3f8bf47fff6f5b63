"""The GPU check's table logic on the CPU (scripts/gpu_check.py): the rollout and learner parts at the tiny shape,
the orchestration through a child process, the pytest report and the end-to-end figures, so that none of it is
dead code on a machine without a GPU. The measurements themselves count only on a GPU."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_rollout_part_at_the_tiny_shape_on_cpu(gpu_check, tmp_path):
    log = gpu_check.RowLog(tmp_path / "rows.jsonl")
    # the compiled engines (rollout.compile) are left out here: Inductor's CPU compile is the slow test's
    # (tests/test_engine_device.py), and their rows are the eager engines' rows
    engines = tuple(e for e in gpu_check.ENGINES if not e.endswith(" compiled"))
    assert engines != gpu_check.ENGINES and all(e.replace(" compiled", "") in engines for e in gpu_check.ENGINES)
    rows = gpu_check.rollout_part("tiny", "cpu", "float32", lengths=(24, 40), batches={24: 2, 40: 1}, new_tokens=3,
                                  budget_gib=None, engines=engines, log=log)
    order = ("hf generate", "smd snapkv 0.5", "smd snapkv 0.5 k64", "smd dense")  # generate first: the anchor
    assert [r.item for r in rows] == [f"P={p} B={b} {e}" for p, b in ((24, 2), (40, 1)) for e in order]
    for r in rows:
        assert r.part == "rollout" and r.result.endswith(" tok/s") and float(r.result.split()[0]) > 0
        assert "x generate" in r.detail and "peak n/a on the CPU" in r.detail
    assert all(r.detail.startswith("1.00x generate") for r in rows if r.item.endswith("hf generate"))
    # smd's host-side shadow-mask bookkeeping (sample_results) is timed apart, out of the tokens/s
    assert all("untimed" in r.detail for r in rows if r.item.startswith("smd") or " smd " in r.item)
    # smd's decoding step is timed apart from its prefill, beside its HBM floor (n/a: the CPU has no HBM figure)
    assert all("decode step" in r.detail and "x its HBM floor n/a" in r.detail
               for r in rows if " smd " in r.item)
    assert not any("decode step" in r.detail for r in rows if r.item.endswith("hf generate"))
    # every row was written to the rows file as it was measured, with a started record before it
    reader = gpu_check.RowReader(tmp_path / "rows.jsonl")
    assert reader.new() == rows and reader.running is None


def test_hbm_floor_by_device_name(gpu_check, monkeypatch):
    import torch

    assert math.isnan(gpu_check.hbm_bandwidth("cpu"))
    for name, bandwidth in (("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
                            ("NVIDIA GeForce RTX 4090", float("nan"))):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device, name=name: name)
        got = gpu_check.hbm_bandwidth("cuda")
        assert got == bandwidth or (math.isnan(got) and math.isnan(bandwidth))


def test_a_failing_measurement_is_its_row_and_the_part_goes_on(gpu_check):
    rows = gpu_check.rollout_part("tiny", "cpu", "float32", lengths=(24,), batches={24: 1}, new_tokens=2,
                                  budget_gib=None, engines=("hf generate", "no such engine", "smd dense"))
    table = {r.item: r for r in rows if not r.item.startswith("warm-up")}
    assert table["P=24 B=1 no such engine"].result == "ERROR"
    assert table["P=24 B=1 no such engine"].detail.startswith("ValueError: unknown engine 'no such engine'")
    assert table["P=24 B=1 smd dense"].result.endswith(" tok/s")
    assert [r.item for r in rows if r.item.startswith("warm-up")] == ["warm-up no such engine"]


def test_learner_part_and_the_table_through_a_child_process(gpu_check, capsys):
    code = gpu_check.main(["--parts", "learner", "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                           "--learner-lengths", "48", "--learner-modes", "dense,smd_sdpa,smd_gather"])
    captured = capsys.readouterr()
    assert code == 0
    lines = captured.out.splitlines()
    assert lines[0].startswith("smd GPU check: ") and "shape tiny float32" in lines[0]
    assert lines[2].split() == ["part", "item", "result", "detail"]
    body = lines[4:lines.index("", 4)]
    assert [ln.split("  ")[1].strip() for ln in body] == [
        "T=48 dense learner", "T=48 smd (sdpa)", "T=48 physical KV slicing"]
    assert all(" s/step " in ln and "x dense time, peak n/a on the CPU" in ln for ln in body)
    assert "1.00x dense time" in body[0]
    assert lines[lines.index("", 4) + 1:] == ["0 passed, 0 failed, 0 skipped; 3 measured rows",
                                               "cut to fit: nothing"]
    # each row was echoed to stderr while the part ran
    assert captured.err.count("gpu check row: learner | T=48 ") == 3


def test_learner_rows_name_out_of_memory_and_errors(gpu_check):
    row = gpu_check.learner_row({"T": 16384, "mode": "smd_gather", "status": "OOM at 131.2 GiB"})
    assert (row.item, row.result, row.detail) == ("T=16384 physical KV slicing", "OOM at 131.2 GiB", "")
    row = gpu_check.learner_row({"T": 8, "mode": "dense", "status": "ERROR: RuntimeError: boom"})
    assert (row.result, row.detail) == ("ERROR", "RuntimeError: boom")
    assert gpu_check.is_failure(row) and gpu_check.is_failure(gpu_check.Row("l", "x", "OOM at 1.0 GiB"))


PYTEST_PART = """
import time, pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 2 + 2 == 5, "four is not five"

@pytest.mark.skip(reason="not on this machine")
def test_skipped():
    pass

def test_hangs():
    open("hanging", "w").close()
    time.sleep(600)

def test_never_reached():
    pass
"""


def test_a_pytest_part_killed_mid_run_keeps_the_tests_it_finished(gpu_check, tmp_path):
    """pytest killed while a test hangs (stopped through the check's stop event once the hanging test runs, so the
    test does not depend on how fast pytest starts; the time limit takes the same path: next test)."""
    (tmp_path / "test_part.py").write_text(PYTEST_PART)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_check_plugin",
           "test_part.py"]
    stop = threading.Event()

    def watch():
        while not (tmp_path / "hanging").exists() and not stop.is_set():
            time.sleep(0.1)
        stop.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        rows = gpu_check.run_child("correctness", cmd, limit_s=300, cwd=tmp_path, stop=stop)
    finally:
        stop.set()
    got = [(r.item, r.result) for r in rows]
    assert got == [("test_passes", "PASS"), ("test_fails", "FAIL"), ("test_skipped", "SKIP"),
                   ("test_hangs", "STOPPED")]
    assert rows[1].detail.startswith("AssertionError: four is not five")
    assert rows[2].detail == "not on this machine"
    assert rows[3].detail == "stopped by a signal; 3 rows above kept"
    assert gpu_check.tally(rows) == {"PASS": 1, "SKIP": 1, "failed": 2, "measured": 0}
    assert not gpu_check.check_passed(rows, cuda=False)


def test_a_child_killed_mid_part_keeps_its_rows_and_a_crash_is_a_row(gpu_check, tmp_path):
    script = ("import sys, time; sys.path.insert(0, {root!r}); import importlib.util as u; "
              "s = u.spec_from_file_location('gc', {path!r}); m = u.module_from_spec(s); sys.modules['gc'] = m; "
              "s.loader.exec_module(m); import os; log = m.RowLog(os.environ[m.ROWS_ENV]); "
              "log.add(m.Row('learner', 'T=8 dense learner', '0.1 s/step')); log.start('learner', 'T=8 smd'); {then}")
    fmt = {"root": str(ROOT), "path": str(ROOT / "scripts" / "gpu_check.py")}
    rows = gpu_check.run_child("learner", [sys.executable, "-c", script.format(then="time.sleep(600)", **fmt)],
                               limit_s=5)
    assert [(r.item, r.result) for r in rows] == [("T=8 dense learner", "0.1 s/step"), ("T=8 smd", "TIMEOUT")]
    rows = gpu_check.run_child("learner", [sys.executable, "-c", script.format(then="raise SystemExit('boom')",
                                                                                  **fmt)], limit_s=60)
    assert [(r.item, r.result) for r in rows] == [("T=8 dense learner", "0.1 s/step"), ("T=8 smd", "ERROR")]
    assert rows[1].detail == "exit 1: boom"


def test_the_shared_deadline_cuts_parts_and_the_table_says_so(gpu_check, capsys):
    code = gpu_check.main(["--parts", "correctness,learner", "--device", "cpu", "--total-s", "10"])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert [ln.split()[:4] for ln in out[4:6]] == [["correctness", "not", "run", "CUT"],
                                                    ["learner", "not", "run", "CUT"]]
    assert out[-2] == "0 passed, 2 failed, 0 skipped; 0 measured rows"
    assert out[-1].startswith("cut to fit: correctness: not run (") and "left of the 10s deadline" in out[-1]


def test_preflight_on_the_cpu_skips_the_gpu_checks(gpu_check):
    rows = {r.item: r for r in gpu_check.preflight_part("cpu")}
    assert rows["python"].result == "ok" and rows["torch"].result == "ok" and rows["imports"].result == "ok"
    assert rows["Python.h"].result == "ok" and rows["Python.h"].detail.endswith("Python.h")
    for item in ("CUDA device", "free device memory", "flex fwd+bwd float32", "flex fwd+bwd bfloat16"):
        assert rows[item].result == "SKIP" and "only a CUDA device" in rows[item].detail


@pytest.mark.slow
def test_a_failed_preflight_stops_the_check(gpu_check, monkeypatch, capsys):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    code = gpu_check.main(["--parts", "preflight,learner", "--device", "cpu", "--shape", "tiny"])
    out = capsys.readouterr().out
    assert code == 1
    assert "C compiler" in out and "none of $CC, cc, gcc, clang on PATH" in out
    assert [ln for ln in out.splitlines() if ln.startswith("learner")][0].split()[:4] == [
        "learner", "not", "run", "CUT"]
    assert "preflight failed: C compiler" in out


def test_install_rows_and_summary(gpu_check, tmp_path):
    log = tmp_path / "install.tsv"
    log.write_text("bad-1.0-py3-none-any.whl\tFAIL\tERROR: bad.whl is not a valid wheel filename\n"
                   "wheels/*.whl\tFAIL\t14 installed, 1 failed (pip, one at a time), 9s\n")
    rows = gpu_check.install_rows(log)
    assert [(r.part, r.item, r.result) for r in rows] == [("install", "bad-1.0-py3-none-any.whl", "FAIL"),
                                                           ("install", "wheels/*.whl", "FAIL")]
    skip = gpu_check.Row("correctness", "t", "SKIP", "needs a CUDA GPU")
    assert gpu_check.check_passed([skip], cuda=False) and not gpu_check.check_passed([skip], cuda=True)
    assert gpu_check.summary_lines([skip], cuda=True)[-1] == "1 SKIP rows on a CUDA device: the check does not pass"


def test_e2e_rows_from_the_run_directory(gpu_check, tmp_path):
    (tmp_path / "artifacts" / "warmstart").mkdir(parents=True)
    (tmp_path / "artifacts" / "warmstart" / "metrics.json").write_text(
        json.dumps({"exact_match": 0.25, "steps": 900, "minutes": 1.5}))
    base = tmp_path / "run" / "artifacts" / "iter-001"
    for stage, name, data in (("rollout", "metrics.json", {"reward/mean": 0.5, "rollout/tokens_per_s": 1234.0}),
                              ("learn", "details.json", {"mismatch/logprob_abs_diff_max": 3e-6,
                                                         "attention_backend": "flex"}),
                              ("evaluate", "metrics.json", {"eval/dense/score": 0.4})):
        (base / stage).mkdir(parents=True)
        (base / stage / name).write_text(json.dumps(data))
    rows = gpu_check.e2e_rows(tmp_path, 1, [("init-model", 3.2, "ok"), ("chain (1 iterations)", 40.0, "ok")])
    table = {r.item: r.result for r in rows}
    assert table["init-model"] == "ok" and table["warm start exact_match"] == "0.250"
    assert table["iter 1 reward/mean"] == "0.500" and table["iter 1 rollout/tokens_per_s"] == "1234"
    assert table["iter 1 mismatch/logprob_abs_diff_max"] == "3.00e-06"
    assert table["iter 1 learner/peak_device_mb"] == "absent"  # no GPU: the learner records no device peak
    assert table["iter 1 learner attention_backend"] == "flex"
    text = gpu_check.format_table(rows, "title")
    assert text.splitlines()[0] == "title" and len(text.splitlines()) == len(rows) + 4


def test_row_reader_reads_complete_lines_and_tracks_what_runs(gpu_check, tmp_path):
    path = tmp_path / "rows.jsonl"
    log, reader = gpu_check.RowLog(path), gpu_check.RowReader(path)
    assert reader.new() == [] and reader.running is None  # no file yet
    log.start("e2e", "chain (2 iterations)")
    log.add(gpu_check.Row("e2e", "iter 1 reward/mean", "0.500"))  # a figure harvested while the chain runs
    with open(path, "a") as f:
        f.write('{"part": "e2e", "item": "cut')  # a line still being written
    assert [r.item for r in reader.new()] == ["iter 1 reward/mean"]
    assert reader.running == "chain (2 iterations)"
    with open(path, "a") as f:
        f.write(' short", "result": "ok"}\n')
    assert [r.item for r in reader.new()] == ["cut short"]
    log.add(gpu_check.Row("e2e", "chain (2 iterations)", "ok", "90s"))
    assert [r.result for r in reader.new()] == ["ok"] and reader.running is None
