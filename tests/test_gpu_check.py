"""The GPU check's table logic on the CPU (scripts/gpu_check.py): the rollout and learner parts at the tiny shape,
the orchestration through a child process, the pytest report and the end-to-end figures, so that none of it is
dead code on a machine without a GPU. The measurements themselves count only on a GPU."""

from __future__ import annotations

import importlib.util
import json
import sys
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


def test_rollout_part_at_the_tiny_shape_on_cpu(gpu_check):
    rows = gpu_check.rollout_part("tiny", "cpu", "float32", lengths=(24, 40), batches={24: 2, 40: 1}, new_tokens=3,
                                  budget_gib=None)
    assert [r.item for r in rows] == [f"P={p} B={b} {e}" for p, b in ((24, 2), (40, 1)) for e in gpu_check.ENGINES]
    for r in rows:
        assert r.part == "rollout" and r.result.endswith(" tok/s") and float(r.result.split()[0]) > 0
        assert "x generate" in r.detail and "peak n/a on the CPU" in r.detail
    assert all(r.detail.startswith("1.00x generate") for r in rows if r.item.endswith("hf generate"))


def test_learner_part_and_the_table_through_a_child_process(gpu_check, capsys):
    code = gpu_check.main(["--parts", "learner", "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                           "--learner-lengths", "48", "--learner-modes", "dense,smd_sdpa,smd_gather"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("smd GPU check: ") and "shape tiny float32" in lines[0]
    assert lines[2].split() == ["part", "item", "result", "detail"]
    body = [ln for ln in lines[4:] if ln]
    assert [ln.split("  ")[1].strip() for ln in body] == [
        "T=48 dense learner", "T=48 smd (sdpa)", "T=48 physical KV slicing"]
    assert all(" s/step " in ln and "x dense time, peak n/a on the CPU" in ln for ln in body)
    assert "1.00x dense time" in body[0]


def test_pytest_report_rows(gpu_check, tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu" name="test_a[snapkv-float32]" time="2.5"/>'
        '<testcase classname="tests.test_gpu" name="test_b" time="0.1"><failure message="assert 2e-05 &lt;= 1e-05'
        '&#10;more">trace</failure></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c" time="0"><skipped message="needs a CUDA GPU"/>'
        '</testcase></testsuite></testsuites>')
    rows = gpu_check.pytest_rows(xml)
    assert [(r.item, r.result, r.detail) for r in rows] == [
        ("test_a[snapkv-float32]", "PASS", "2.5s"), ("test_b", "FAIL", "assert 2e-05 <= 1e-05"),
        ("test_c", "SKIP", "needs a CUDA GPU")]


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
