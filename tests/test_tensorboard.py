"""The TensorBoard view of a run: TensorBoard's own reader sees every learner step and every iteration's headline,
and the same artifacts give the same bytes."""

from __future__ import annotations

import json

import pytest

from schemas.layout import RunLayout
from stages.progress.stage import run_progress
from stages.progress.tensorboard import EVENT_FILE

pytest.importorskip("tensorboard")


def _scalars(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _fake_run(root):
    run = RunLayout(root)
    run.warmstart.mkdir(parents=True)
    (run.warmstart / "metrics.json").write_text(json.dumps({"reward": 0.25, "exact_match": 0.125}))
    (run.warmstart / "details.json").write_text(json.dumps(
        {"reward": 0.25, "exact_match": 0.125, "rewards/f/mean": 0.75, "rewards/f/std": 0.5, "config": {}}))
    for n, steps in ((1, [1, 2]), (2, [3])):
        it = run.iteration(n)
        for stage in ("rollout", "learn", "evaluate"):
            it.stage(stage).mkdir(parents=True)
        (it.rollout / "metrics.json").write_text(json.dumps({"reward/mean": 0.5 + n / 10}))
        (it.evaluate / "metrics.json").write_text(json.dumps({"eval/dense/score": 0.4 + n / 10}))
        (it.learn / "steps.json").write_text(json.dumps(
            [{"step": s, "epoch": 0, "loss/total": s / 4, "grad_norm": float("nan"), "ok": True} for s in steps]))
    return run


def test_view_holds_every_step_and_iteration_and_is_deterministic(tmp_path):
    run = _fake_run(tmp_path / "a")
    run_progress(2, run.artifacts)
    learn = _scalars(run.tensorboard / "learn" / EVENT_FILE)
    assert learn == {"loss/total": [(1, 0.25), (2, 0.5), (3, 0.75)]}  # one curve over the global step; NaN dropped
    per_iteration = _scalars(run.tensorboard / "iteration" / EVENT_FILE)
    assert per_iteration["eval/dense/score"] == [(0, 0.25), (1, pytest.approx(0.5)), (2, pytest.approx(0.6))]
    assert per_iteration["reward/mean"] == [(1, pytest.approx(0.6)), (2, pytest.approx(0.7))]
    assert per_iteration["eval/dense/rewards/f/mean"] == [(0, 0.75)]  # the warm start's per-function mean
    first = (run.tensorboard / "learn" / EVENT_FILE).read_bytes()
    run_progress(2, run.artifacts)  # rebuilt, not appended to
    assert (run.tensorboard / "learn" / EVENT_FILE).read_bytes() == first
    other = _fake_run(tmp_path / "b")
    run_progress(2, other.artifacts)
    assert (other.tensorboard / "iteration" / EVENT_FILE).read_bytes() == \
        (run.tensorboard / "iteration" / EVENT_FILE).read_bytes()


def test_view_follows_the_iteration_progress_ran_for(tmp_path):
    run = _fake_run(tmp_path)
    run_progress(1, run.artifacts)
    assert _scalars(run.tensorboard / "learn" / EVENT_FILE) == {"loss/total": [(1, 0.25), (2, 0.5)]}
