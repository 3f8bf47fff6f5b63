"""`evaluate:` section: held-out evaluation."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EvaluateParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(16, ge=1, description="Greedy response length limit.")
    batch_size: int = Field(16, ge=1, description="Sequences decoded together.")
