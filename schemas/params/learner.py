"""`learner:` section: objective, optimisation and DeepSpeed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

OBJECTIVES = ("smd", "shadow", "dense", "tis", "sparse_rl")


class LearnerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    objective: str = Field("smd", description=f"One of {OBJECTIVES}.")
    kl_lambda: float = Field(0.1, ge=0.0, description="Weight of KL(sg[pi_dense] || pi_masked) in `smd`.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
