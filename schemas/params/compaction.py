"""`compaction:` section: raw masks -> learner-ready mask store (schemas.compacted_masks)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CompactionParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chunk_rows: int = Field(
        8,
        ge=1,
        description="Trajectories per chunk of the compacted store (match the learner micro-batch): a chunk spans "
        "the most tokens of any chunk_rows consecutive rows, so one micro-batch read touches at most two chunks.",
    )
    compression_level: int = Field(3, ge=1, le=9, description="Blosc/zstd compression level (Blosc accepts 1-9).")
