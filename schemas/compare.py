"""The spec of a comparison (`smdctl compare`): arms as `-S` overrides of one params file, seeds, run length.

Every arm runs the same params (the hyper-parameters of params.yaml) with only its own overrides, so no arm
is tuned alone; the spec is validated whole (every arm's params included) before anything runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas.errors import SmdInputError

_ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]*$")


class CompareSpec(BaseModel):
    """Arms x seeds of `smdctl chain` runs, then one `smdctl report`."""

    model_config = ConfigDict(extra="forbid")
    iterations: int = Field(8, ge=1, description="On-policy iterations per run.")
    eval_every: int = Field(4, ge=0, description="Evaluate every K iterations (and the last; iteration 0 always); "
                            "0: no evaluation at all (timing runs, quick sweeps).")
    seeds: list[int] = Field([0, 1, 2], min_length=1, description="Seeds per arm (`-S seed=...`).")
    workers: int = Field(2, ge=1, description="Runs at a time; each gets the caller's OMP_NUM_THREADS, else the "
                         "CPUs the process may use (its affinity) // workers torch threads.")
    common: dict[str, Any] = Field(
        {}, description="{dotted param key: value} overrides every arm shares (sizing: batch, eval), applied first.",
    )
    arms: dict[str, dict[str, Any]] = Field(
        ..., min_length=1, description="Arm name -> {dotted param key: value} overrides of the params file.",
    )

    @field_validator("arms")
    @classmethod
    def _names(cls, arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in arms:
            if not _ARM_NAME.match(name):
                raise ValueError(f"arm name {name!r}: use letters, digits and _ . @ + - (it names a directory)")
        return arms

    def overrides(self, arm: str) -> list[str]:
        """The shared and then the arm's overrides as `-S key=value` strings (values in YAML syntax)."""
        items = [*self.common.items(), *self.arms[arm].items()]
        return [f"{key}={_yaml_scalar(value)}" for key, value in items]


def _yaml_scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text[:-4].strip() if text.endswith("\n...") or text.endswith(" ...") else text.removesuffix("...").strip()


def load_compare_spec(path: str | Path) -> CompareSpec:
    """Read and validate a comparison spec; one line naming the file and field on error."""
    path = Path(path)
    if not path.is_file():
        raise SmdInputError(f"{path}: no such comparison spec")
    try:
        tree = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SmdInputError(f"{path}: not valid YAML ({exc.__class__.__name__})") from exc
    if not isinstance(tree, dict):
        raise SmdInputError(f"{path}: top level must be a mapping (iterations, eval_every, seeds, workers, arms)")
    try:
        return CompareSpec.model_validate(tree)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise SmdInputError(f"{path}: {where}: {err['msg']}") from None
