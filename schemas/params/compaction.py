"""`compaction:` section: raw masks -> learner-ready mask store."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CompactionParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chunk_rows: int = Field(8, ge=1, description="Trajectories per chunk (match the learner micro-batch).")
    compression_level: int = Field(3, ge=1, le=22, description="zstd level.")
