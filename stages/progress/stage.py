"""Per-iteration progress series for DVC plots and the default experiment's summary.

`run_progress(i)` gathers, for iterations 1..i, the headline numbers of rollout, learn and evaluate metrics
into `artifacts/iter-NNN/progress.json`: `{"schema_version", "kind": "progress", "config", "rows": [...]}`,
one row per iteration, which `dvc plots show` draws (it plots the file's list of rows); then rebuilds the
run's TensorBoard view (`stages.progress.tensorboard`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.feather as feather

from schemas.atomic import atomic_path
from schemas.layout import DETAILS, METRICS, PROVENANCE, RunLayout
from schemas.metrics import read_json_object
from stages.progress.tensorboard import write_tensorboard

PROGRESS_SCHEMA_VERSION = 1
PROGRESS_KIND = "progress"

HEADLINE = {
    "rollout": ["reward/mean", "kv/kept_fraction", "rollout/tokens_per_s"],
    "learn": ["mismatch/logprob_abs_diff_max", "mismatch/logprob_abs_diff_mean", "mismatch/kl",
              "mismatch/rollout_is_eff_sample_size", "mismatch/seq_kish_ess", "rejection/seq_fraction",
              "rejection/token_fraction", "loss/total", "grad_norm", "policy/entropy", "pg/clipfrac",
              "batch/zero_adv_group_frac"],
    "evaluate": ["eval/dense/score", "eval/compressed/score", "eval/dense/exact_match", "eval/compressed/exact_match",
                 "eval/dense/reference_nll"],
}


REWARD_MEAN = re.compile(r"(eval/(dense|compressed)/)?rewards/.+/mean")


def _read(path: Path) -> dict:
    return read_json_object(path) if path.exists() else {}


def iteration_row(artifacts: Path, n: int) -> dict:
    it = RunLayout(artifacts).iteration(n)
    row: dict = {"iteration": n}
    for stage, keys in HEADLINE.items():
        # the stage's whole record (details.json) when present, else its DVC headline
        data = _read(it.stage(stage) / DETAILS) or _read(it.stage(stage) / METRICS)
        for key in keys:
            if key in data and isinstance(data[key], int | float):
                row[key] = data[key]
        # with reward functions: each function's mean and a verl function's numeric extras (rewards/<fn>/<key>/mean),
        # as TRL and verl log them, so TensorBoard shows them per iteration (issue 41)
        for key, value in data.items():
            if REWARD_MEAN.fullmatch(key) and isinstance(value, int | float) and not isinstance(value, bool):
                row[key] = value
    return row


def run_progress(iteration: int, artifacts: str | Path = "artifacts") -> Path:
    artifacts = Path(artifacts)
    rows = [iteration_row(artifacts, n) for n in range(1, iteration + 1)]
    out = RunLayout(artifacts).iteration(iteration).progress
    record = {"schema_version": PROGRESS_SCHEMA_VERSION, "kind": PROGRESS_KIND,
              "config": {"iteration": iteration, "artifacts": str(artifacts)}, "rows": rows}
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(record, indent=2))
    # TensorBoard's view of iterations 0..i (the warm start as 0), from the rows just gathered
    warm = warmstart_row(artifacts)
    write_tensorboard(artifacts, ([warm] if warm else []) + rows, list(range(1, iteration + 1)))
    return out


def warmstart_row(artifacts: Path) -> dict | None:
    """The warm start as iteration 0: its greedy eval is a dense one, reported under the evaluate stage's names
    (with reward functions, each function's mean from its details.json as `eval/dense/rewards/<fn>/mean`)."""
    stage = RunLayout(artifacts).warmstart
    warm = _read(stage / METRICS)
    if not warm:
        return None
    row = {"iteration": 0, **{k: v for k, v in warm.items() if isinstance(v, int | float) and k != "schema_version"}}
    for src, dst in (("reward", "eval/dense/score"), ("exact_match", "eval/dense/exact_match"),
                     ("reference_nll", "eval/dense/reference_nll")):
        if isinstance(warm.get(src), int | float):
            row[dst] = warm[src]
    for key, value in _read(stage / DETAILS).items():
        if key.startswith("rewards/") and REWARD_MEAN.fullmatch(key) and isinstance(value, int | float) \
                and not isinstance(value, bool):
            row[f"eval/dense/{key}"] = value
    return row


def summary_table(artifacts: str | Path = "artifacts") -> list[dict]:
    """Rows for every iteration that has any metrics, the start as iteration 0: the start's evaluation with
    evaluate's settings where a run has one (`iter-000/evaluate`, what `smdctl compare` writes), else the warm
    start stage's own greedy evaluation, marked `"start": "warmstart"` (its settings, e.g. its new-token limit,
    are the warm start's, not evaluate's)."""
    artifacts = Path(artifacts)
    layout = RunLayout(artifacts)
    if (layout.iteration(0).evaluate / METRICS).is_file():
        rows = [{**iteration_row(artifacts, 0), "start": "evaluate"}]
    else:
        warm = warmstart_row(artifacts)
        rows = [{**warm, "start": "warmstart"}] if warm else []
    rows.extend(iteration_row(artifacts, n) for n in layout.iterations())
    return rows


def _config(path: Path) -> dict:
    config = _read(path).get("config")
    return config if isinstance(config, dict) else {}


def model_label(path: str | Path) -> str:
    """A model directory as a person names it: the source file's name of a converted model (`provenance.json`
    of `smdctl convert-model`), else the directory's name, with its architecture and size from config.json."""
    path = Path(path)
    provenance = _read(path / PROVENANCE) if (path / PROVENANCE).is_file() else {}
    source = provenance.get("source")
    name = Path(source["path"]).stem if isinstance(source, dict) and isinstance(source.get("path"), str) else None
    config = _read(path / "config.json") if (path / "config.json").is_file() else {}
    shape = ", ".join(str(x) for x in (
        (config.get("architectures") or [None])[0],
        f"{config['num_hidden_layers']} layers" if "num_hidden_layers" in config else None,
        f"hidden {config['hidden_size']}" if "hidden_size" in config else None) if x)
    label = name or path.name
    return f"{label} ({shape})" if shape else label


def run_title(artifacts: str | Path = "artifacts") -> str:
    """`smd: <task> on <model>` for a run's artifacts: the task of its prompts (the eval predictions' or the
    trajectories' `task`), the model its chain started from (the warm start's model.init_path, else the policy
    iteration 1 sampled with)."""
    artifacts = Path(artifacts)
    layout = RunLayout(artifacts)
    task = None
    for n in [0, *layout.iterations()]:
        for table in (layout.iteration(n).predictions, layout.iteration(n).trajectories):
            if table.is_file():
                column = feather.read_table(table, columns=["task"]).column("task")
                task = column[0].as_py() if len(column) else None
                break
        if task:
            break
    start = _config(layout.warmstart / DETAILS).get("model", {}).get("init_path") or _config(
        layout.iteration(1).rollout / DETAILS).get("policy")
    model = model_label(start) if start else "an unknown model"
    return f"smd: {task or 'unknown task'} on {model}"


def parity_note(artifacts: str | Path = "artifacts") -> str | None:
    """One line under `smdctl summary`'s table saying what the |dlogp| column's figures are held to: the largest
    rollout/learner gap over the iterations, the learner's gate (`learner/parity_tol` of that iteration's record)
    and the float32 rounding bound (docs/design.md section 3). None when no iteration has learned yet."""
    artifacts = Path(artifacts)
    worst: tuple[float, int, float | None] | None = None
    for n in RunLayout(artifacts).iterations():
        learn = RunLayout(artifacts).iteration(n).stage("learn")
        data = _read(learn / DETAILS) or _read(learn / METRICS)
        gap = data.get("mismatch/logprob_abs_diff_max")
        if isinstance(gap, int | float) and (worst is None or gap > worst[0]):
            tol = data.get("learner/parity_tol")
            worst = (float(gap), n, float(tol) if isinstance(tol, int | float) else None)
    if worst is None:
        return None
    gate = f"the learner's gate {worst[2]:g} (learner.parity_tol)" if worst[2] is not None else "the learner's gate"
    return (f"|dlogp| max: the rollout/learner log-prob gap before each update; largest {worst[0]:.2g} (iteration "
            f"{worst[1]}), held to {gate}. In float32 rounding explains up to 16 eps x max|logit| / temperature "
            "(~1.5e-5 on the tiny default model, 7.7e-5 on SmolLM2-135M; docs/design.md section 3); afterwards "
            "the metrics measure policy drift.")
