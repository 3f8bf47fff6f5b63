"""TensorBoard curves of a run: `tensorboard --logdir <run>` (or `--logdir artifacts`) shows them, as with TRL and verl.

The progress stage rebuilds `<artifacts>/tensorboard/` from the run's artifacts after every iteration, so the
view always matches what is on disk (a rerun iteration replaces its points instead of adding a second copy):
- `learn/`: every learner step's scalars from `iter-NNN/learn/steps.json`, at the learner's global step
  (the step counter continues across iterations, so the iterations form one curve);
- `iteration/`: per iteration, the headline of the rollout, learn and evaluate stages (the rows of
  `progress.json`), the warm start's evaluation as iteration 0.

Event files are written with TensorBoard's own protobufs and record writer. An event's wall time is its step
(not the clock), and the file name is fixed, so the same metrics give the same bytes (two runs differ only
where their metrics do: the wall-clock figures). Without the `tensorboard` package the view is skipped with
one line (the lent GPU machine's image may lack it); nothing else depends on it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from schemas.atomic import atomic_path
from schemas.layout import STEPS, RunLayout

EVENT_FILE = "events.out.tfevents.smd"  # TensorBoard reads any file whose name holds "tfevents"
# steps.json keys that are bookkeeping, not curves.
_NOT_CURVES = frozenset({"step", "epoch"})


def write_event_file(path: Path, scalars: Iterable[tuple[str, int, float]]) -> None:
    """A TensorBoard event file at `path` holding (tag, step, value) scalars (non-finite values skipped)."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    with open(path, "wb") as f:
        writer = RecordWriter(f)
        writer.write(event_pb2.Event(wall_time=0.0, file_version="brain.Event:2").SerializeToString())
        for tag, step, value in scalars:
            if not math.isfinite(value):
                continue
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
            writer.write(event_pb2.Event(wall_time=float(step), step=int(step), summary=summary).SerializeToString())
        writer.flush()


def learner_scalars(run: RunLayout, iterations: list[int]) -> list[tuple[str, int, float]]:
    """(tag, global step, value) of every learner step of `iterations` (steps.json)."""
    out = []
    for n in iterations:
        path = run.iteration(n).learn / STEPS
        if not path.is_file():
            continue
        for record in json.loads(path.read_text()):
            step = record.get("step")
            if not isinstance(step, int):
                continue
            out.extend((tag, step, float(v)) for tag, v in sorted(record.items())
                       if tag not in _NOT_CURVES and isinstance(v, int | float) and not isinstance(v, bool))
    return out


def iteration_scalars(rows: list[dict]) -> list[tuple[str, int, float]]:
    """(tag, iteration, value) of the per-iteration rows (`progress.json` rows, the warm start as 0)."""
    return [(tag, int(row["iteration"]), float(v)) for row in rows for tag, v in sorted(row.items())
            if tag != "iteration" and isinstance(v, int | float) and not isinstance(v, bool)]


def write_tensorboard(artifacts: str | Path, rows: list[dict], iterations: list[int]) -> Path | None:
    """Rebuild `<artifacts>/tensorboard/` (atomically) from the learner steps of `iterations` and the
    per-iteration `rows`; returns its path, or None when the `tensorboard` package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        print("tensorboard is not installed: no TensorBoard view written (pip install tensorboard)")
        return None
    run = RunLayout(Path(artifacts))
    with atomic_path(run.tensorboard) as tmp:
        for name, scalars in (("learn", learner_scalars(run, iterations)), ("iteration", iteration_scalars(rows))):
            (tmp / name).mkdir(parents=True)
            write_event_file(tmp / name / EVENT_FILE, scalars)
    return run.tensorboard
