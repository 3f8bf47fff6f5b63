"""`prepare` stage: synthetic task generators, data set loaders, prompt tables (rewards: schemas.rewards)."""

from stages.prepare.stage import run_prepare

__all__ = ["run_prepare"]
