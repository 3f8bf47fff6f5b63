"""Validated parameters: params.yaml is the single source of truth, one section per stage.

Every section is a pydantic model with documented fields and defaults (extra keys are rejected),
so a typo or an out-of-range value fails before any stage runs, naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.errors import SmdInputError
from schemas.params.compaction import CompactionParams
from schemas.params.evaluate import EvaluateParams
from schemas.params.learner import LearnerParams
from schemas.params.model import ModelParams
from schemas.params.prepare import PrepareParams
from schemas.params.rollout import EvictionParams, RolloutParams
from schemas.params.warmstart import WarmstartParams

__all__ = [
    "Params",
    "ModelParams",
    "PrepareParams",
    "WarmstartParams",
    "RolloutParams",
    "EvictionParams",
    "CompactionParams",
    "LearnerParams",
    "EvaluateParams",
    "PipelineParams",
    "load_params",
    "apply_overrides",
]


class IterationItem(BaseModel):
    """One on-policy iteration of dvc.yaml's static chain; it names the policy it starts from."""

    model_config = ConfigDict(extra="forbid")
    n: int = Field(..., ge=1, description="Iteration number (1-based).")
    id: str = Field(..., pattern=r"^\d{3}$", description="Zero-padded number used in artifact paths (iter-NNN).")
    policy: str = Field(..., description="Policy checkpoint this iteration samples with (its predecessor's output).")


def default_chain(iterations: int) -> dict[str, IterationItem]:
    """Items keyed by iteration number, so DVC names the stages rollout@1, learn@2, ..."""
    items = {}
    for n in range(1, iterations + 1):
        policy = "artifacts/warmstart/policy" if n == 1 else f"artifacts/iter-{n - 1:03d}/policy"
        items[str(n)] = IterationItem(n=n, id=f"{n:03d}", policy=policy)
    return items


class PipelineParams(BaseModel):
    """The iteration chain of dvc.yaml (`foreach` over these items). Extend it by adding the item
    `'3': {n: 3, id: '003', policy: artifacts/iter-002/policy}` (each names its predecessor's policy)."""

    model_config = ConfigDict(extra="forbid")
    iterations: dict[str, IterationItem] = Field(
        default_factory=lambda: default_chain(2),
        description="Iteration items keyed by number, each naming the policy it starts from.",
    )

    @model_validator(mode="after")
    def _chain(self) -> PipelineParams:
        if not self.iterations:
            raise ValueError("at least one iteration is required")
        expected = default_chain(len(self.iterations))
        for key, want in expected.items():
            got = self.iterations.get(key)
            if got != want:
                raise ValueError(
                    f"iteration '{key}' must be {{n: {want.n}, id: '{want.id}', policy: {want.policy}}}"
                )
        return self


class Params(BaseModel):
    """The whole params.yaml."""

    model_config = ConfigDict(extra="forbid")
    seed: int = Field(0, ge=0, description="Global seed; each stage derives its own from it and the iteration.")
    model: ModelParams = ModelParams()
    prepare: PrepareParams = PrepareParams()
    warmstart: WarmstartParams = WarmstartParams()
    rollout: RolloutParams = RolloutParams()
    compaction: CompactionParams = CompactionParams()
    learner: LearnerParams = LearnerParams()
    evaluate: EvaluateParams = EvaluateParams()
    pipeline: PipelineParams = PipelineParams()


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise SmdInputError(f"override {dotted}: {key} is not a section")
    node[keys[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Apply `section.key=value` overrides (values parsed as YAML scalars) to a raw params tree."""
    for item in overrides or []:
        if "=" not in item:
            raise SmdInputError(f"override {item!r}: expected KEY=VALUE, e.g. rollout.eviction.keep_ratio=0.5")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return tree


def format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "<root>"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    return f"{source}: {where}: {msg}"


def load_params(path: str | Path | None = "params.yaml", overrides: list[str] | None = None) -> Params:
    """Read params.yaml (missing file = all defaults), apply overrides, validate.

    Raises SmdInputError with one line naming the file and the key on any problem.
    """
    tree: dict[str, Any] = {}
    source = str(path) if path else "<defaults>"
    if path is not None and Path(path).exists():
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as exc:
            raise SmdInputError(f"{source}: not valid YAML ({exc.__class__.__name__})") from exc
        if not isinstance(tree, dict):
            raise SmdInputError(f"{source}: top level must be a mapping of sections")
    apply_overrides(tree, overrides)
    try:
        return Params.model_validate(tree)
    except ValidationError as err:
        raise SmdInputError(format_validation_error(err, source)) from err
