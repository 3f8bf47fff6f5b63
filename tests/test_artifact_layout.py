"""schemas.layout names exactly the paths dvc.yaml declares (outs, metrics, plots), so the CLI, the chain, the
comparison runner, the report and the progress stage write and read what `dvc repro` tracks."""

from __future__ import annotations

from pathlib import Path

import yaml

from schemas.layout import DETAILS, METRICS, STEPS, RunLayout, iteration_id

ROOT = Path(__file__).resolve().parents[1]


def _declared(stage: dict) -> set[str]:
    out = set()
    for key in ("outs", "metrics", "plots"):
        for entry in stage.get(key, []):
            out.add(next(iter(entry)) if isinstance(entry, dict) else entry)
    return out


def test_layout_names_every_declared_path():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    run = RunLayout(Path("artifacts"))
    it = run.iteration(7)
    expected = {
        "init-model": {run.model_init},
        "prepare": {run.train_prompts, run.eval_prompts, run.data / DETAILS, run.data / "stats.json"},
        "warmstart": {run.warmstart_policy, run.warmstart / DETAILS, run.warmstart / METRICS},
        "rollout": {it.trajectories, it.raw_masks, it.rollout / DETAILS, it.rollout / METRICS},
        "compact": {it.masks, it.compact / DETAILS, it.compact / METRICS},
        "learn": {it.policy, it.learn / METRICS, it.learn / STEPS},
        "evaluate": {it.predictions, it.evaluate / DETAILS, it.evaluate / METRICS},
        "progress": {it.progress},
        "headline": {run.headline},
    }
    assert set(expected) <= set(stages)
    for name, paths in expected.items():
        stage = stages[name].get("do", stages[name])
        declared = {p.replace("${item.id}", iteration_id(7)) for p in _declared(stage)}
        assert declared == {p.as_posix() for p in paths}, name


def test_start_policy_and_iterations(tmp_path):
    run = RunLayout(tmp_path)
    assert run.start_policy(1) == tmp_path / "warmstart" / "policy"
    assert run.start_policy(1, "elsewhere") == Path("elsewhere")
    assert run.start_policy(3) == tmp_path / "iter-002" / "policy"
    for n in (1, 2, 4):  # a gap at 3: iterations stop at the first missing directory
        run.iteration(n).root.mkdir(parents=True)
    assert run.iterations() == [1, 2]
