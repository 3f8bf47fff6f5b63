"""Held-out evaluation (dense and compressed greedy inference) and the cross-experiment report."""

from stages.evaluate.stage import evaluate

__all__ = ["evaluate"]
