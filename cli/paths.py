"""Default artifact paths of the pipeline (the same ones dvc.yaml declares)."""

from __future__ import annotations

from pathlib import Path

from schemas.layout import IterationLayout, RunLayout

RUN = RunLayout()  # `dvc repro`'s artifacts/
ARTIFACTS = RUN.artifacts
WARMSTART_POLICY = RUN.warmstart_policy


def iteration_layout(iteration: int) -> IterationLayout:
    return RUN.iteration(iteration)


def policy_for_iteration(iteration: int) -> Path:
    """The policy iteration i samples with: the warm-start policy for i = 1, else iteration i-1's."""
    return RUN.start_policy(iteration)
