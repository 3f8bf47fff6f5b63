"""`warmstart` stage: supervised training of the policy on the task's train split."""

from stages.warmstart.train import run_warmstart

__all__ = ["run_warmstart"]
