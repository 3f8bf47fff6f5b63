"""Rollout/learner mismatch metrics (verl/TRL names) and a finiteness guard.

Direction: the samples come from the rollout policy, so the KL estimated on them is
KL(pi_rollout || pi_learner) = E_{o ~ pi_rollout}[log pi_rollout(o) - log pi_learner(o)].
Under SMD, before the first optimizer step, pi_learner (shadow-masked) == pi_rollout and every metric is
neutral (kl 0, diff 0, ratios 1, ess 1) up to float error (docs/design.md: max |diff| <= 1e-5); afterwards
they measure policy drift. For the dense baselines they measure the context mismatch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from schemas.errors import SmdInputError

__all__ = ["mismatch_metrics", "check_finite"]


def check_finite(name: str, tensor: Tensor, mask: Tensor | None = None) -> None:
    """Raise SmdInputError (one line, naming `name`) if `tensor` holds NaN/inf (only where `mask`, if given)."""
    bad = ~torch.isfinite(tensor)
    if mask is not None:
        if mask.shape != tensor.shape:
            raise SmdInputError(
                f"{name}: mask shape {tuple(mask.shape)} does not match {tuple(tensor.shape)}"
            )
        bad &= mask if mask.dtype == torch.bool else mask != 0
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise SmdInputError(
            f"{name}: {int(bad.sum())} non-finite value(s) (NaN/inf), first at index {tuple(idx)}: {tensor[tuple(idx)].item()}"
        )


def mismatch_metrics(learner_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Mismatch between the learner's and the rollout's log-probs of the sampled tokens, `[B, T]` each.

    With d_t = learner_logp_t - rollout_logp_t over valid tokens (token means over all valid tokens):
      mismatch/kl                      mean(-d_t): k1 estimate of KL(pi_rollout || pi_learner)
      mismatch/k3_kl                   mean(exp(d_t) - 1 - d_t): k3 estimate of the same KL (>= 0)
      mismatch/logprob_abs_diff_mean   mean |d_t|
      mismatch/logprob_abs_diff_max    max |d_t|
      mismatch/is_ratio_{mean,min,max} token ratio exp(d_t) = pi_learner / pi_rollout
      mismatch/ess                     normalised effective sample size of the sequence-level weights
                                       w_i = exp(sum_t d_it): (sum w)^2 / (N sum w^2) in (0, 1], over the N
                                       sequences with at least one valid token (log-space, no overflow).
    Python floats. No valid token gives the neutral values (0, 0, 0, 0, 1, 1, 1, 1).
    """
    if learner_logp.shape != rollout_logp.shape or mask.shape != learner_logp.shape:
        raise SmdInputError(
            f"mismatch_metrics: shapes differ: learner_logp {tuple(learner_logp.shape)}, "
            f"rollout_logp {tuple(rollout_logp.shape)}, mask {tuple(mask.shape)}"
        )
    valid = mask if mask.dtype == torch.bool else mask != 0
    if not valid.any():
        return {
            "mismatch/kl": 0.0,
            "mismatch/k3_kl": 0.0,
            "mismatch/logprob_abs_diff_mean": 0.0,
            "mismatch/logprob_abs_diff_max": 0.0,
            "mismatch/is_ratio_mean": 1.0,
            "mismatch/is_ratio_min": 1.0,
            "mismatch/is_ratio_max": 1.0,
            "mismatch/ess": 1.0,
        }
    with torch.no_grad():
        d_full = torch.where(
            valid, learner_logp.double() - rollout_logp.double(), torch.zeros((), dtype=torch.float64)
        )
        d = d_full[valid]
        ratio = torch.exp(d)
        seq_log_w = d_full.sum(dim=-1)[valid.any(dim=-1)]
        n = seq_log_w.numel()
        log_ess = 2 * torch.logsumexp(seq_log_w, 0) - math.log(n) - torch.logsumexp(2 * seq_log_w, 0)
        return {
            "mismatch/kl": float((-d).mean()),
            "mismatch/k3_kl": float((torch.expm1(d) - d).mean()),
            "mismatch/logprob_abs_diff_mean": float(d.abs().mean()),
            "mismatch/logprob_abs_diff_max": float(d.abs().max()),
            "mismatch/is_ratio_mean": float(ratio.mean()),
            "mismatch/is_ratio_min": float(ratio.min()),
            "mismatch/is_ratio_max": float(ratio.max()),
            "mismatch/ess": float(torch.exp(log_ess).clamp(max=1.0)),
        }
