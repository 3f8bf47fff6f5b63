"""The artifact layout of a run: every path `dvc.yaml` declares, named once.

A run's artifacts live under one directory (`artifacts/` for `dvc repro`, `<run-dir>/artifacts` for
`smdctl chain` and `smdctl compare`):

    model/init/                          init-model
    data/{train,eval}.arrow              prepare
    warmstart/{policy,metrics.json,details.json}
    iter-NNN/rollout/{trajectories.arrow,masks.raw.zarr,metrics.json,details.json}
    iter-NNN/compact/{masks.zarr,metrics.json,details.json}
    iter-NNN/policy/                     learn (Hugging Face format + optimizer state)
    iter-NNN/learn/{metrics.json,details.json,steps.json}
    iter-NNN/evaluate/{predictions.arrow,metrics.json,details.json}
    iter-NNN/progress.json
    metrics.json                         headline (the last iteration; the only DVC `metrics` file)
    tensorboard/{learn,iteration}/       the progress stage's TensorBoard view (not a DVC output)

The CLI, the in-process chain, the comparison runner, the report and the progress stage take their paths
from here; tests/test_artifact_layout.py checks them against the `outs`, `metrics` and `plots` of dvc.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TRAIN_PROMPTS = "train.arrow"
EVAL_PROMPTS = "eval.arrow"
TRAJECTORIES = "trajectories.arrow"
RAW_MASKS = "masks.raw.zarr"
MASKS = "masks.zarr"
PREDICTIONS = "predictions.arrow"
METRICS = "metrics.json"
DETAILS = "details.json"
# `smdctl convert-model`'s record in the model directory it writes (stages/common/convert.py).
PROVENANCE = "provenance.json"
STEPS = "steps.json"
PROGRESS = "progress.json"
# The per-iteration stage directories that hold a metrics.json (report and progress read these).
METRIC_STAGES = ("rollout", "compact", "learn", "evaluate")


def iteration_id(n: int) -> str:
    """The zero-padded iteration number of artifact paths (iter-NNN) and of dvc.yaml's `${item.id}`."""
    return f"{n:03d}"


@dataclass(frozen=True)
class IterationLayout:
    """The artifacts of iteration `n` under `root` (= <artifacts>/iter-NNN)."""

    root: Path
    n: int

    def stage(self, name: str) -> Path:
        """A stage's own directory (rollout, compact, learn, evaluate): metrics.json and details.json."""
        return self.root / name

    @property
    def rollout(self) -> Path:
        return self.root / "rollout"

    @property
    def trajectories(self) -> Path:
        return self.rollout / TRAJECTORIES

    @property
    def raw_masks(self) -> Path:
        return self.rollout / RAW_MASKS

    @property
    def compact(self) -> Path:
        return self.root / "compact"

    @property
    def masks(self) -> Path:
        return self.compact / MASKS

    @property
    def policy(self) -> Path:
        return self.root / "policy"

    @property
    def learn(self) -> Path:
        return self.root / "learn"

    @property
    def evaluate(self) -> Path:
        return self.root / "evaluate"

    @property
    def predictions(self) -> Path:
        return self.evaluate / PREDICTIONS

    @property
    def progress(self) -> Path:
        return self.root / PROGRESS


@dataclass(frozen=True)
class RunLayout:
    """The artifacts of one run under `artifacts`."""

    artifacts: Path = Path("artifacts")

    def __post_init__(self) -> None:
        object.__setattr__(self, "artifacts", Path(self.artifacts))

    @property
    def model_init(self) -> Path:
        return self.artifacts / "model" / "init"

    @property
    def data(self) -> Path:
        return self.artifacts / "data"

    @property
    def train_prompts(self) -> Path:
        return self.data / TRAIN_PROMPTS

    @property
    def eval_prompts(self) -> Path:
        return self.data / EVAL_PROMPTS

    @property
    def warmstart(self) -> Path:
        return self.artifacts / "warmstart"

    @property
    def warmstart_policy(self) -> Path:
        return self.warmstart / "policy"

    @property
    def headline(self) -> Path:
        """The run's headline figures (the last iteration's, and the warm start's dense score): dvc.yaml's one
        `metrics` file, written by the headline stage (`stages.progress.headline`)."""
        return self.artifacts / METRICS

    @property
    def tensorboard(self) -> Path:
        """TensorBoard's view of the run (rebuilt by the progress stage; not a DVC output)."""
        return self.artifacts / "tensorboard"

    def iteration(self, n: int) -> IterationLayout:
        return IterationLayout(self.artifacts / f"iter-{iteration_id(n)}", n)

    def start_policy(self, n: int, warmstart: str | Path | None = None) -> Path:
        """The policy iteration n samples with: the warm-start policy (or `warmstart`) for n = 1, else
        iteration n-1's output."""
        if n <= 1:
            return Path(warmstart) if warmstart is not None else self.warmstart_policy
        return self.iteration(n - 1).policy

    def iterations(self) -> list[int]:
        """The iterations 1, 2, ... whose directory exists, up to the first gap."""
        found, n = [], 1
        while self.iteration(n).root.exists():
            found.append(n)
            n += 1
        return found
