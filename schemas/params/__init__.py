"""Validated parameters: params.yaml is the single source of truth, one section per stage.

Every section is a pydantic model with documented fields and defaults (extra keys are rejected),
so a typo or an out-of-range value fails before any stage runs, naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class PipelineParams(BaseModel):
    """The iteration chain of dvc.yaml."""

    model_config = ConfigDict(extra="forbid")
    iterations: int = Field(2, ge=1, le=999, description="Number of on-policy iterations (rollout, compact, learn, evaluate).")


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
