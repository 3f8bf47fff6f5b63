"""The full-logits reference of the learner's objective: smd's dense-teacher KL from `[B, T, V]` logits.

The learner never holds `[B, T, V]` logits: it gets the teacher KL per token from the hidden states in token chunks
(`stages.learner.logprobs.chunked_token_scores`, `ObjectiveBatch.kl_per_token`). This module computes the same
term from the full logits (`dense_teacher_kl_per_token`), the reference that the chunked path is checked against
(tests/test_objectives.py, tests/test_logprobs_chunked.py) and timed against (the `*_full` modes of
`stages.bench.learner`). The learner stage does not import it.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor

from schemas.errors import SmdInputError
from schemas.params.learner import LearnerParams
from stages.learner.objectives import (
    ObjectiveBatch,
    dense_teacher_kl_per_token,
    objective_loss,
    objective_spec,
)


def full_logits_objective_loss(
    params: LearnerParams,
    batch: ObjectiveBatch,
    *,
    masked_logits: Tensor | None = None,
    dense_logits: Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    """`objective_loss` with the dense-teacher KL per token computed from the response-position logits
    `masked_logits`, `dense_logits` `[B, T, V]` (before `temperature`; the dense ones detached) when the batch has
    no `kl_per_token`. For smd with kl_lambda > 0 they are required (with gradient through the masked ones); for
    smd at kl_lambda 0 and shadow they are optional and only logged (computed without gradient)."""
    spec = objective_spec(params.objective)
    if spec.masked_forward and batch.kl_per_token is None:
        trained = spec.dense_teacher and params.kl_lambda > 0
        if masked_logits is not None and dense_logits is not None:
            with contextlib.nullcontext() if trained else torch.no_grad():
                kl = dense_teacher_kl_per_token(masked_logits, dense_logits, temperature)
            batch = dataclasses.replace(batch, kl_per_token=kl)
        elif trained:
            missing = [n for n, t in (("masked_logits", masked_logits), ("dense_logits", dense_logits)) if t is None]
            raise SmdInputError(f"objective {params.objective!r} needs {', '.join(missing)}")
    return objective_loss(params, batch)
