"""Compaction stage: raw rollout masks -> learner-ready mask store (`schemas.compacted_masks`)."""

from stages.compaction.compact import run_compaction

__all__ = ["run_compaction"]
