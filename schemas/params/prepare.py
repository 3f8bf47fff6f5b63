"""`prepare:` section: which task and how much of it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PrepareParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: str = Field("kv_retrieval", description="Task name (synthetic generator or dataset loader).")
    num_train: int = Field(2048, ge=1, description="Train prompts.")
    num_eval: int = Field(64, ge=1, description="Held-out prompts.")
    context_tokens: int = Field(128, ge=16, description="Approximate prompt length of synthetic tasks, in tokens.")
