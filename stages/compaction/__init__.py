"""Compaction stage: raw rollout masks -> learner-ready mask store (`schemas.mask_store`)."""

from stages.compaction.compact import compact

__all__ = ["compact"]
