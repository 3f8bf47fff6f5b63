"""Rollout/learner mismatch metrics and a finiteness guard.

Names: where a metric carries verl's name (`rollout_corr/*` in verl's rollout-correction helper) it has
verl's definition, by version: smd follows verl 0.9.1 (`verl/trainer/ppo/rollout_corr_helper.py`,
`compute_rollout_correction_weights` -> `compute_is_metrics`, token level, a single threshold C = TIS) by
default; `VERL_RULES` names the versions whose rules differ. Quantities verl does not define get names of
their own (token_ratio_*, seq_kish_ess).

verl's ESS by version: up to 0.8 (e.g. 0.8.0.dev, Jan 2026) `rollout_is_eff_sample_size` clamps the token
weights to [1/C, C] before normalising; 0.9.1 clamps the applied (already truncated) weights to [0, C], so the
ESS is that of the weights the loss uses, min(w, C). The two differ whenever a ratio falls below 1/C.

Direction: the samples come from the rollout policy, so the KL estimated on them is
KL(pi_rollout || pi_learner) = E_{o ~ pi_rollout}[log pi_rollout(o) - log pi_learner(o)].
Under SMD, before the first optimizer step, pi_learner (shadow-masked) == pi_rollout and every metric is
neutral (kl 0, diff 0, ratios 1, ESS 1) up to float error (docs/design.md: max |diff| <= 1e-5); afterwards
they measure policy drift. For the dense baselines they measure the context mismatch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from schemas.errors import SmdInputError

__all__ = ["mismatch_metrics", "check_finite", "VERL_RULES", "DEFAULT_VERL_RULE"]

# verl version -> the lower clamp of the ESS weights as a function of the cap C (the upper clamp is C in both)
VERL_RULES = {"0.9.1": lambda cap: 0.0, "0.8": lambda cap: 1.0 / cap}
DEFAULT_VERL_RULE = "0.9.1"
# verl's SAFETY_BOUND: log-ratios are clamped to [-20, 20] before exp (rollout_corr_helper.py)
SAFETY_BOUND = 20.0


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


NEUTRAL = {
    "mismatch/kl": 0.0,
    "mismatch/k3_kl": 0.0,
    "mismatch/logprob_abs_diff_mean": 0.0,
    "mismatch/logprob_abs_diff_max": 0.0,
    "mismatch/token_ratio_mean": 1.0,
    "mismatch/token_ratio_min": 1.0,
    "mismatch/token_ratio_max": 1.0,
    "mismatch/seq_kish_ess": 1.0,
    "mismatch/rollout_is_mean": 1.0,
    "mismatch/rollout_is_min": 1.0,
    "mismatch/rollout_is_max": 1.0,
    "mismatch/rollout_is_eff_sample_size": 1.0,
}


def mismatch_metrics(learner_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float = 2.0,
                     verl_rule: str = DEFAULT_VERL_RULE) -> dict[str, float]:
    """Mismatch between the learner's and the rollout's log-probs of the sampled tokens, `[B, T]` each.

    With d_t = learner_logp_t - rollout_logp_t over valid tokens (token means over all valid tokens):
      mismatch/kl                      mean(-d_t): k1 estimate of KL(pi_rollout || pi_learner) (verl's
                                       rollout_corr/kl)
      mismatch/k3_kl                   mean(exp(d_t) - 1 - d_t): k3 estimate of the same KL (>= 0; verl's
                                       rollout_corr/k3_kl)
      mismatch/logprob_abs_diff_mean   mean |d_t|
      mismatch/logprob_abs_diff_max    max |d_t|
      mismatch/token_ratio_{mean,min,max}  raw token ratio exp(d_t) = pi_learner / pi_rollout
      mismatch/seq_kish_ess            Kish normalised effective sample size of the unclamped sequence-level
                                       weights w_i = exp(sum_t d_it): (sum w)^2 / (N sum w^2) in (0, 1], over
                                       the N sequences with at least one valid token (log space, no overflow)
      mismatch/rollout_is_{mean,min,max}  verl's rollout_is_* (token level, truncate mode): the token weights
                                       min(exp(d_t), cap) (d_t clamped to verl's +-20 first)
      mismatch/rollout_is_eff_sample_size  verl's rollout_is_eff_sample_size: with the token weights clamped to
                                       [lower, cap] and w_norm = w / mean(w), 1 / mean(w_norm^2) in (0, 1];
                                       lower = 0 (verl 0.9.1, the default) or 1/cap (verl <= 0.8), `verl_rule`
    `cap` is verl's rollout_is_threshold (learner.tis_cap). Python floats. No valid token gives `NEUTRAL`.
    (verl divides by mean(w) + 1e-8 and does not cap the ESS at 1; smd divides by mean(w) exactly and caps
    float rounding above 1: the two differ by < 1e-7 relative for the weights here, mean(w) >= exp(-20).)
    """
    if learner_logp.shape != rollout_logp.shape or mask.shape != learner_logp.shape:
        raise SmdInputError(
            f"mismatch_metrics: shapes differ: learner_logp {tuple(learner_logp.shape)}, "
            f"rollout_logp {tuple(rollout_logp.shape)}, mask {tuple(mask.shape)}"
        )
    if not cap >= 1:
        raise SmdInputError(f"mismatch_metrics: cap must be >= 1, got {cap}")
    if verl_rule not in VERL_RULES:
        raise SmdInputError(f"mismatch_metrics: verl_rule {verl_rule!r}: expected one of {sorted(VERL_RULES)}")
    valid = mask if mask.dtype == torch.bool else mask != 0
    if not valid.any():
        return dict(NEUTRAL)
    with torch.no_grad():
        d_full = torch.where(
            valid, learner_logp.double() - rollout_logp.double(), torch.zeros((), dtype=torch.float64, device=valid.device)
        )
        d = d_full[valid]
        ratio = torch.exp(d)
        seq_log_w = d_full.sum(dim=-1)[valid.any(dim=-1)]
        n = seq_log_w.numel()
        log_ess = 2 * torch.logsumexp(seq_log_w, 0) - math.log(n) - torch.logsumexp(2 * seq_log_w, 0)
        truncated = torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND)).clamp(max=cap)  # verl's applied TIS weights
        w = truncated.clamp(min=VERL_RULES[verl_rule](cap), max=cap)
        w_norm = w / w.mean()
        return {
            "mismatch/kl": float((-d).mean()),
            "mismatch/k3_kl": float((torch.expm1(d) - d).mean()),
            "mismatch/logprob_abs_diff_mean": float(d.abs().mean()),
            "mismatch/logprob_abs_diff_max": float(d.abs().max()),
            "mismatch/token_ratio_mean": float(ratio.mean()),
            "mismatch/token_ratio_min": float(ratio.min()),
            "mismatch/token_ratio_max": float(ratio.max()),
            "mismatch/seq_kish_ess": float(torch.exp(log_ess).clamp(max=1.0)),
            "mismatch/rollout_is_mean": float(truncated.mean()),
            "mismatch/rollout_is_min": float(truncated.min()),
            "mismatch/rollout_is_max": float(truncated.max()),
            "mismatch/rollout_is_eff_sample_size": float((1.0 / (w_norm * w_norm).mean()).clamp(max=1.0)),
        }
