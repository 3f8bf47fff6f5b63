"""Held-out evaluation: dense and compressed greedy inference through the shared evicting engine."""

from stages.evaluate.stage import run_evaluate

__all__ = ["run_evaluate"]
