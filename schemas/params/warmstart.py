"""`warmstart:` section: supervised training so RL starts above zero reward."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WarmstartParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(600, ge=0, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Sequences per step.")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate.")
