"""`smdctl bench learner --sequence-parallel N` (stages/bench/learner_sp.py): the table's rows at a tiny shape on 2
processes, with the one-process loss (no timing or memory assertions: the machine is shared), and its refusals."""

from __future__ import annotations

import math

import pytest


@pytest.mark.slow  # ~40-110 s on 2 shared cores: three processes start and import torch (two also DeepSpeed)
def test_the_bench_runs_one_and_two_processes_with_equal_losses():
    from stages.bench.learner_sp import bench_learner_sequence_parallel

    printed: list[str] = []
    rows = bench_learner_sequence_parallel(2, shape="tiny", lengths=[64], rows=2, print_fn=printed.append)
    assert [(r["processes"], r["backend"], r["T"]) for r in rows] == [(1, "tiled", 64), (2, "tiled", 64)]
    one, two = rows
    assert len(one["rank_peak_mb"]) == 1 and len(two["rank_peak_mb"]) == 2
    assert one["ratio"] == 1.0 or math.isnan(one["ratio"])  # NaN where /proc/self/clear_refs cannot be written
    assert one["response_tokens"] == two["response_tokens"] == 16 + 14  # rows of 64 and 56 tokens, 1/4 response
    # equal results: the same loss, log-probs and (summed over the group) gradient norm, to float32 rounding
    assert two["loss_diff"] <= 1e-5 * max(abs(one["loss"]), 1.0)
    assert two["logp_diff"] <= 1e-4 and two["grad_norm_rel_diff"] <= 1e-4
    assert all(r["step_s"] > 0 for r in rows)
    header = next(i for i, line in enumerate(printed) if line.lstrip().startswith("processes"))
    assert "peak/proc MiB" in printed[header] and "|d loss|" in printed[header]
    assert [line.split()[:3] for line in printed[header + 1 : header + 3]] == [["1", "tiled", "64"],
                                                                            ["2", "tiled", "64"]]
    assert printed[-1].startswith("target peak per process <= 0.6x one process's")


@pytest.mark.parametrize("argv,message", [
    (["--sequence-parallel", "3"], "does not divide the model's 8 KV heads"),  # qwen3-0.6b-4l: 8 KV heads
    (["--sequence-parallel", "2", "--backend", "eager"], "--backend 'eager'"),
    (["--sequence-parallel", "2", "--shape", "nope"], "unknown shape 'nope'"),
])
def test_a_split_the_model_cannot_take_is_refused_before_any_process_starts(argv, message):
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, ["bench", "learner", *argv])
    assert result.exit_code == 2, result.output
    assert message in result.output
