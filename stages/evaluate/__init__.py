"""Held-out evaluation: dense and compressed greedy inference through the shared evicting engine."""

from stages.evaluate.stage import evaluate

__all__ = ["evaluate"]
