"""The default experiment's headline: `artifacts/metrics.json`, the one DVC `metrics` file of dvc.yaml.

`run_headline(iteration, progress, warmstart, out)` writes the figures of the chain's last iteration, taken
from the last row of its `progress.json` (the row `smdctl progress` gathered from that iteration's rollout,
learn and evaluate metrics), plus the warm start's held-out dense score from `warmstart/metrics.json`. The
keys are flat and short (HEADLINE_KEYS), so `dvc metrics show` is one row that fits 160 columns and
`dvc exp show` one narrow metrics group per experiment. The per-stage `metrics.json` / `details.json` files
stay where they are (uncached DVC outs, not metrics): the progress stage, `smdctl summary`, `smdctl report`
and TensorBoard read them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from schemas.metrics import read_json_object

HEADLINE_SCHEMA_VERSION = 1
PROGRESS_KIND = "progress"  # the `kind` of progress.json (stages.progress.stage.PROGRESS_KIND)
# (headline key, the stage whose metrics hold it, its key there and in progress.json's rows)
HEADLINE_KEYS = [
    ("iteration", None, "iteration"),
    ("reward", "rollout", "reward/mean"),                                # train reward of the rollouts
    ("dense", "evaluate", "eval/dense/score"),                           # held-out score, dense KV cache
    ("compressed", "evaluate", "eval/compressed/score"),                 # held-out score, rollout's compression
    ("dense_em", "evaluate", "eval/dense/exact_match"),
    ("compressed_em", "evaluate", "eval/compressed/exact_match"),
    ("ref_nll", "evaluate", "eval/dense/reference_nll"),                 # reference answer's NLL, dense
    ("kv_kept", "rollout", "kv/kept_fraction"),
    ("dlogp_max", "learn", "mismatch/logprob_abs_diff_max"),             # max |learner - rollout| log-prob
    ("mismatch_kl", "learn", "mismatch/kl"),
]
# The warm start's greedy eval-split score (`reward` of warmstart/metrics.json) is a dense score: iteration 0.
WARMSTART_KEY = ("warm_dense", "reward")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _load(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise SmdInputError(f"{path}: missing ({what})")
    return read_json_object(path)


def last_row(progress: str | Path, iteration: int) -> dict[str, Any]:
    """The row of `iteration` in its progress.json: the file's last row, checked to be that iteration's."""
    progress = Path(progress)
    data = _load(progress, f"run `smdctl progress --iteration {iteration}` first")
    if data.get("kind") != PROGRESS_KIND:
        raise SmdInputError(f"{progress}: kind: expected {PROGRESS_KIND!r}, found {data.get('kind')!r}")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise SmdInputError(f"{progress}: rows: expected a non-empty list of iteration rows")
    row = rows[-1]
    if not isinstance(row, dict):
        raise SmdInputError(f"{progress}: rows[-1]: expected an object, found a {type(row).__name__}")
    if row.get("iteration") != iteration:
        raise SmdInputError(f"{progress}: rows[-1].iteration: is {row.get('iteration')!r}, expected {iteration}")
    return row


def headline_record(row: dict[str, Any], warmstart: dict[str, Any] | None = None,
                    source: str = "progress.json", warm_source: str = "warmstart/metrics.json") -> dict[str, Any]:
    """The headline of a progress row (and the warm start's metrics): HEADLINE_KEYS that the row has, in order.
    A key the row lacks is left out (DVC shows `-`); one that is not a number is bad input."""
    out: dict[str, Any] = {}
    for key, _, progress_key in HEADLINE_KEYS:
        if progress_key not in row:
            continue
        value = row[progress_key]
        if not _number(value):
            raise SmdInputError(f"{source}: rows[-1].{progress_key}: expected a number, found {value!r}")
        out[key] = value
    key, warm_key = WARMSTART_KEY
    if warmstart is not None and warm_key in warmstart:
        if not _number(warmstart[warm_key]):
            raise SmdInputError(f"{warm_source}: {warm_key}: expected a number, found {warmstart[warm_key]!r}")
        out[key] = warmstart[warm_key]
    return out


def run_headline(iteration: int, progress: str | Path, warmstart: str | Path, out: str | Path) -> Path:
    """Write `out` (artifacts/metrics.json): iteration `iteration`'s headline from `progress` (its progress.json)
    and the warm start's dense score from `warmstart` (warmstart/metrics.json), atomically. Returns `out`."""
    row = last_row(progress, iteration)
    warm = _load(Path(warmstart), "the warmstart stage writes it")
    record = headline_record(row, warm, str(progress), str(warmstart))
    out = Path(out)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
    return out
