"""Default artifact paths of the pipeline (the same ones dvc.yaml declares)."""

from __future__ import annotations

from pathlib import Path

from schemas.params import start_policy

ARTIFACTS = Path("artifacts")
WARMSTART_POLICY = ARTIFACTS / "warmstart" / "policy"


def iteration_dir(iteration: int) -> Path:
    return ARTIFACTS / f"iter-{iteration:03d}"


def policy_for_iteration(iteration: int) -> Path:
    """The policy iteration i samples with: the warm-start policy for i = 1, else iteration i-1's."""
    return start_policy(iteration, ARTIFACTS)
