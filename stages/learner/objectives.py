"""The learner's objective math: small pure torch functions, and one registered function per objective.

Conventions (every function):
- Per-token tensors are padded `[B, T]` over the response tokens; `mask` (bool, or float 0/1) marks the valid
  ones. Padded positions never reach a result, even if they hold NaN or inf (selected out with `where`).
- `logp` tensors are log-probabilities of the sampled tokens under the sampling distribution, i.e.
  `log_softmax(logits / temperature)` gathered at the token (see `token_logprobs`).
- Losses are minimised. Everything that is a target (old/rollout/reference log-probs, advantages, importance
  weights, the dense teacher) is detached inside the function, so a caller that forgot `no_grad` cannot leak
  gradient into it.
- No hyperparameter has a default here: the defaults live in `schemas.params.learner.LearnerParams` only.

Concept: docs/concepts/objectives.md (each objective, its forward, its old policy and its source).

Objectives (docs/design.md section 7, each matched to its source). Each is one function registered with
`register_objective(name, ...)` (verl's `POLICY_LOSS_REGISTRY` pattern), taking the validated `LearnerParams`
and an `ObjectiveBatch`, with an `ObjectiveSpec` of what the learner runs for it; `objective_loss(params,
batch)` dispatches on `params.objective`:
- smd:          pg(masked_logp vs rollout_logp) + kl_lambda * KL(sg[pi_dense] || pi_masked), the KL over the
                tokens of `learner.kl_tokens` (`ObjectiveBatch.kl_mask`; all response tokens by default)
- shadow:       pg(masked_logp vs rollout_logp)                     (no dense pass)
- naive:        pg(dense_logp vs old_logp), old = the dense learner's log-probs before the first update (ratio 1
                at the first step), the rollout/learner mismatch ignored: what a framework (verl, slime, OpenRLHF
                with recomputed old log-probs) does when its rollout engine compresses the KV cache.
- naive_bypass: pg(dense_logp vs rollout_logp): the sparse rollout's log-probs taken as the old policy (verl's
                "bypass" of the old-log-prob recomputation); the ratio is pi_dense / pi_sparse from the first step.
- dense:        the same rule as naive_bypass, named for dense rollouts, where the two log-probs coincide.
- tis:          pg(dense_logp vs old_logp) * min(pi_old / pi_rollout, C)  (verl's decoupled truncated IS)
- sparse_rl:    Sparse-RL (arXiv 2601.10079; the official lsjia/Sparse-RL code, slime `mis` configuration):
                pg(dense_logp vs old_logp) over the kept tokens of the kept sequences, each weighted by
                min(pi_old / pi_rollout, 1.5) normalised to mean 1 over the mini-batch; per-sequence token mean.
- smd_released: the SMD authors' released code (huthvincent/RL-Post-Training-with-KV-Cache-Compression @ 26029e8,
                SMD/src/shadow_distillation_loss.py): pg(dense_logp vs old_logp, old = recomputed) over the trusted
                tokens (shadow-mask visibility <= retention + 0.05, `stages.learner.released`) + kl_lambda *
                mean(clamp(rollout_logp - dense_logp, min=0)) over every valid token; both per-sequence means.
plus `ref_kl_coef * KL(pi || pi_ref)` when a reference is configured. Every policy term is dual-clipped
(verl's clip_ratio_c = 3) where A < 0. Every objective returns its terms under the names the learner logs
(`LOSS_TERMS`, the `pg/*` stats of `policy_loss`, `is_weight/mean`, `rejection/*`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from schemas.errors import SmdInputError
from schemas.params.learner import LOSS_AGGS, OBJECTIVES, REF_KL_KINDS, TIS_LEVELS, LearnerParams

__all__ = [
    "OBJECTIVES",
    "LOSS_AGGS",
    "LOSS_TERMS",
    "KL_TOKEN_FRACTION",
    "ObjectiveBatch",
    "ObjectiveSpec",
    "OBJECTIVE_REGISTRY",
    "register_objective",
    "objective_spec",
    "objective_loss",
    "token_logprobs",
    "aggregate",
    "group_advantages",
    "policy_loss",
    "dense_teacher_kl_per_token",
    "dense_teacher_kl",
    "reference_kl",
    "tis_weights",
    "sparse_rl_rejection",
    "sparse_rl_rules",
    "one_sided_distillation_per_token",
    "TRUSTED_FRACTION",
    "sparse_rl_weight_sums",
    "rejection_fractions",
    "loss_agg_for",
    "token_entropy",
    "zero_advantage_group_fraction",
]

# The loss terms every objective returns (python floats), under the names the learner logs (learn/steps.json,
# details.json): the policy term, smd's dense-teacher KL, the reference KL, and their weighted sum.
LOSS_TERMS = ("loss/pg", "loss/kl_dense", "loss/kl_ref", "loss/total")
# The fraction of the valid response tokens smd's dense-teacher KL applied to (`learner.kl_tokens`, `kl_mask`),
# logged per step when the learner runs the teacher (1.0 for `all`).
KL_TOKEN_FRACTION = "kl/token_fraction"
# smd_released: the per-sequence mean fraction of the valid response tokens its trusted-token filter keeps in the
# policy term (`ObjectiveBatch.trusted_mask`), logged per step.
TRUSTED_FRACTION = "released/trusted_fraction"

# exp() of a log-ratio beyond this overflows float32 soon after; verl clamps at the same value.
_LOG_RATIO_CLAMP = 20.0


# ----------------------------------------------------------------------------------------------- helpers
def _valid(mask: Tensor, like: Tensor, name: str = "mask") -> Tensor:
    if mask.shape != like.shape:
        raise SmdInputError(f"{name}: shape {tuple(mask.shape)} does not match {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def _same_shape(name: str, tensor: Tensor, like: Tensor, like_name: str) -> None:
    if tensor.shape != like.shape:
        raise SmdInputError(
            f"{name}: shape {tuple(tensor.shape)} does not match {like_name} {tuple(like.shape)}"
        )


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SmdInputError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) gathered at `tokens`: `[B, T, V], [B, T] -> [B, T]` (float32)."""
    if temperature <= 0:
        raise SmdInputError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def aggregate(values: Tensor, mask: Tensor, loss_agg: str) -> Tensor:
    """Reduce per-token `values [B, T]` over the valid tokens (verl names).

    token_mean:           sum of valid values / number of valid tokens.
    seq_mean_token_mean:  mean over sequences of (sum of the sequence's valid values / its valid tokens).
    seq_mean_token_sum:   mean over sequences of the sum of the sequence's valid values.
    Sequences with no valid token (padding rows, rejected sequences) do not count in the sequence means.
    No valid token at all gives 0 (still connected to the graph), never NaN.
    """
    _check_choice("loss_agg", loss_agg, LOSS_AGGS)
    valid = _valid(mask, values)
    v = torch.where(valid, values, torch.zeros_like(values))
    if loss_agg == "token_mean":
        return v.sum() / valid.sum().clamp(min=1)
    tokens = valid.sum(dim=-1)
    n_seq = (tokens > 0).sum().clamp(min=1)
    per_seq = v.sum(dim=-1)
    if loss_agg == "seq_mean_token_mean":
        per_seq = per_seq / tokens.clamp(min=1)
    return per_seq.sum() / n_seq


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the sampling distribution softmax(logits / temperature) per position, `[B, T, V] -> [B, T]`
    (float32, nats): -sum_v p(v) log p(v). The policy-entropy diagnostic of verl/TRL (`actor/entropy`)."""
    if temperature <= 0:
        raise SmdInputError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(logits.detach().float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def zero_advantage_group_fraction(rewards: Tensor, group_ids: Tensor) -> float:
    """Fraction of GRPO groups whose rewards are all equal (their advantages are 0: no learning signal).

    `rewards [N]`, `group_ids [N]` any integer labels. A group of one counts as all-equal. 0 groups -> 0.
    """
    if rewards.numel() == 0:
        return 0.0
    inverse = torch.unique(group_ids, return_inverse=True)[1]
    return float(_constant_groups(rewards.detach().double(), inverse).double().mean())


def _constant_groups(r: Tensor, inverse: Tensor, among: Tensor | None = None) -> Tensor:
    """[G] bool: the groups (`inverse` [N] -> 0..G-1) whose values `r` [N] are all equal (over the rows `among`,
    default all; a group with none of them is not constant)."""
    n_groups = int(inverse.max()) + 1
    high = r if among is None else torch.where(among, r, torch.full_like(r, -math.inf))
    low = r if among is None else torch.where(among, r, torch.full_like(r, math.inf))
    gmax = torch.full((n_groups,), -math.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inverse, high, "amax")
    gmin = torch.full((n_groups,), math.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inverse, low, "amin")
    return gmax == gmin


# ------------------------------------------------------------------------------------------- advantages
def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    group_size: int | None = None,
    eps: float = 1e-6,
    scale: str = "std",
    scored: Tensor | None = None,
) -> Tensor:
    """GRPO group-normalised advantages, `[N] -> [N]` (dtype of `rewards`, float32 for integer rewards).

    Groups come from `group_ids [N]` (any integer labels), or `group_size` (consecutive rows).
    scale="std":  (r - mean_g) / (std_g + eps), std_g the unbiased (Bessel) group std, as TRL and verl.
    scale="none": r - mean_g (Dr. GRPO).
    A group whose rewards are all equal, and a group of one, gets exactly 0 (no contrast, no signal).
    `scored [N]` bool (default all True): rows with False, which no reward function could score (every one
    returned None), are left out of their group's mean, std and count and get advantage 0, as TRL's GRPOTrainer
    does from v1.6.0 (PR #5902: `nanmean` / `nanstd` over the group with such rows' rewards set to NaN, their
    advantages zeroed), so an unscorable row neither pulls its siblings' baseline nor is pushed itself.
    Non-finite rewards raise SmdInputError.
    """
    _check_choice("advantage scale", scale, ("std", "none"))
    if rewards.dim() != 1:
        raise SmdInputError(f"rewards: expected shape [N], got {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten()
        raise SmdInputError(
            f"rewards: {bad.numel()} non-finite value(s) (NaN/inf), first at row {int(bad[0])}: {rewards[bad[0]].item()}"
        )
    if (group_ids is None) == (group_size is None):
        raise SmdInputError("group_advantages: pass exactly one of group_ids or group_size")
    if group_ids is None:
        if group_size is None or group_size < 1 or n % group_size:
            raise SmdInputError(f"group_size={group_size} does not divide the {n} rewards into whole groups")
        inverse = torch.arange(n, device=rewards.device) // group_size
    else:
        if group_ids.shape != rewards.shape:
            raise SmdInputError(
                f"group_ids: shape {tuple(group_ids.shape)} does not match rewards {tuple(rewards.shape)}"
            )
        inverse = torch.unique(group_ids, return_inverse=True)[1]
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if n == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    if scored is not None and scored.shape != rewards.shape:
        raise SmdInputError(f"scored: shape {tuple(scored.shape)} does not match rewards {tuple(rewards.shape)}")
    r = rewards.detach().double()
    weight = torch.ones_like(r) if scored is None else scored.to(device=r.device, dtype=torch.float64)
    n_groups = int(inverse.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, weight)
    total = torch.zeros_like(count).index_add_(0, inverse, r * weight)
    mean = (total / count.clamp(min=1))[inverse]
    centred = r - mean
    if scale == "std":
        sq = torch.zeros_like(count).index_add_(0, inverse, centred * centred * weight)
        std = torch.sqrt(sq / (count - 1).clamp(min=1))[inverse]
        centred = centred / (std + eps)
    # Exact zeros for constant groups (r - mean may be 1e-17 off in floating point) and singletons, both judged
    # on the scored rows; unscored rows are 0.
    if scored is None:
        flat = (_constant_groups(r, inverse) | (count < 2))[inverse]
    else:
        flat = (_constant_groups(r, inverse, scored) | (count < 2))[inverse] | ~scored
    centred = torch.where(flat, torch.zeros_like(centred), centred)
    return centred.to(out_dtype)


# ---------------------------------------------------------------------------------------- policy loss
def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    loss_agg: str,
    token_weights: Tensor | None = None,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO/GRPO clipped surrogate, optionally dual-clipped. Returns (loss, stats).

    ratio_t = exp(logp_t - old_logp_t) (log-ratio clamped to +-20 against overflow);
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - clip_eps_low, 1 + clip_eps_high) * A) * w_t,
    with A = advantages[b] broadcast over the sequence and w_t = token_weights (1 if None; detached),
    reduced by `aggregate(loss_agg)`. The learner's default clip is symmetric 0.2 (PPO/GRPO); DAPO's
    clip-higher sets clip_eps_high=0.28. Where the clipped branch is active the token gets no gradient.
    Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; verl's `clip_ratio_c`, default 3):
    where A < 0, loss_t = min(loss_t, -dual_clip_c * A) before the weight, i.e. a token whose ratio exceeds c
    with a negative advantage contributes at most c * |A| and no gradient (verl's compute_policy_loss).
    None = off.

    stats (python floats, over valid tokens): pg/clipfrac (fraction of tokens on the clipped branch),
    pg/dual_clipfrac (fraction capped by the dual clip), pg/ratio_mean, pg/ratio_min, pg/ratio_max,
    pg/approx_kl (mean of old_logp - logp).
    """
    _same_shape("old_logp", old_logp, logp, "logp")
    valid = _valid(mask, logp)
    if advantages.shape != logp.shape[:1]:
        raise SmdInputError(f"advantages: expected shape [{logp.shape[0]}], got {tuple(advantages.shape)}")
    if not (0 < clip_eps_low < 1) or clip_eps_high <= 0:
        raise SmdInputError(
            f"clip range: need 0 < clip_eps_low < 1 and clip_eps_high > 0, got {clip_eps_low}, {clip_eps_high}"
        )
    if dual_clip_c is not None and not dual_clip_c > 1:
        raise SmdInputError(f"dual_clip_c must be > 1 (or None = off), got {dual_clip_c}")
    log_ratio = (logp - old_logp.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(ratio.dtype).unsqueeze(-1)
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    per_token = -torch.minimum(surr, surr_clipped)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip_c is not None:
        cap = -dual_clip_c * adv
        dual = (adv < 0) & (per_token > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    if token_weights is not None:
        _same_shape("token_weights", token_weights, logp, "logp")
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    loss = aggregate(per_token, valid, loss_agg)

    with torch.no_grad():
        n = int(valid.sum())
        if n:
            r = ratio[valid]
            stats = {
                "pg/clipfrac": float((surr_clipped < surr)[valid].float().mean()),
                "pg/dual_clipfrac": float(dual[valid].float().mean()),
                "pg/ratio_mean": float(r.mean()),
                "pg/ratio_min": float(r.min()),
                "pg/ratio_max": float(r.max()),
                "pg/approx_kl": float((-log_ratio)[valid].mean()),
            }
        else:
            stats = {
                "pg/clipfrac": 0.0,
                "pg/dual_clipfrac": 0.0,
                "pg/ratio_mean": 1.0,
                "pg/ratio_min": 1.0,
                "pg/ratio_max": 1.0,
                "pg/approx_kl": 0.0,
            }
    return loss, stats


# ------------------------------------------------------------------------------------------ KL terms
def dense_teacher_kl_per_token(
    masked_logits: Tensor, dense_logits: Tensor, temperature: float = 1.0
) -> Tensor:
    """KL(sg[pi_dense] || pi_masked) per position over the full vocabulary: `[B, T, V] x2 -> [B, T]` (float32).

    = sum_v p_dense(v) * (log p_dense(v) - log p_masked(v)), p = softmax(logits / temperature). The dense
    logits are detached here: the teacher never receives gradient. Vocabulary entries with p_dense = 0
    contribute 0 (not NaN); p_masked = 0 where p_dense > 0 gives +inf, as the KL is.
    """
    if masked_logits.shape != dense_logits.shape:
        raise SmdInputError(
            f"dense_logits: shape {tuple(dense_logits.shape)} does not match masked_logits {tuple(masked_logits.shape)}"
        )
    if temperature <= 0:
        raise SmdInputError(f"temperature must be > 0, got {temperature}")
    log_q = torch.log_softmax(masked_logits.float() / temperature, dim=-1)
    log_p = torch.log_softmax(dense_logits.detach().float() / temperature, dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(log_q))
    return terms.sum(dim=-1)


def dense_teacher_kl(
    masked_logits: Tensor,
    dense_logits: Tensor,
    mask: Tensor,
    *,
    temperature: float = 1.0,
    loss_agg: str,
) -> Tensor:
    """`dense_teacher_kl_per_token` reduced over the valid response tokens with `aggregate(loss_agg)`."""
    per_token = dense_teacher_kl_per_token(masked_logits, dense_logits, temperature)
    return aggregate(per_token, _valid(mask, per_token), loss_agg)


def reference_kl_per_token(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimator of KL(pi || pi_ref) on tokens sampled from pi (Schulman's k1/k2/k3), `[B, T]`.

    With d = ref_logp - logp: k1 = -d; k2 = d^2 / 2; k3 = exp(d) - d - 1 (>= 0, low variance). ref_logp is
    detached.
    """
    _check_choice("reference KL kind", kind, REF_KL_KINDS)
    _same_shape("ref_logp", ref_logp, logp, "logp")
    d = (ref_logp.detach() - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    return torch.exp(d) - d - 1.0


def reference_kl(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, *, kind: str, loss_agg: str
) -> Tensor:
    """`reference_kl_per_token` reduced over the valid tokens with `aggregate(loss_agg)`."""
    per_token = reference_kl_per_token(logp, ref_logp, kind)
    return aggregate(per_token, _valid(mask, logp), loss_agg)


def one_sided_distillation_per_token(rollout_logp: Tensor, dense_logp: Tensor) -> Tensor:
    """The distillation term of the SMD authors' released code per token, `[B, T]`:
    clamp(rollout_logp - dense_logp, min=0), the rollout's log-probs a fixed target (detached here), the gradient
    into the dense log-probs (-1 where the rollout's log-prob exceeds the dense one, else 0; torch's clamp passes
    the gradient at equality). Source: huthvincent/RL-Post-Training-with-KV-Cache-Compression @ 26029e8,
    SMD/src/shadow_distillation_loss.py, `kl_per_token = (shadow_target_lp - dense_lp).clamp(min=0)`."""
    _same_shape("dense_logp", dense_logp, rollout_logp, "rollout_logp")
    return (rollout_logp.detach() - dense_logp).clamp(min=0)


# ----------------------------------------------------------------------------- off-policy corrections
def tis_weights(
    learner_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    level: str,
    cap: float,
) -> Tensor:
    """Truncated importance weights `[B, T]`, detached; 0 at padded positions.

    token:    w_t = min(exp(learner_logp_t - rollout_logp_t), cap)
    sequence: w   = min(exp(sum_t over valid tokens of (learner_logp_t - rollout_logp_t)), cap), the same
              for every valid token of the sequence (computed in log space: no overflow).
    """
    _check_choice("tis level", level, TIS_LEVELS)
    _same_shape("rollout_logp", rollout_logp, learner_logp, "learner_logp")
    valid = _valid(mask, learner_logp)
    if not cap > 0:
        raise SmdInputError(f"importance-weight cap must be > 0, got {cap}")
    with torch.no_grad():
        log_ratio = torch.where(
            valid,
            learner_logp.float() - rollout_logp.float(),
            torch.zeros_like(learner_logp, dtype=torch.float32),
        )
        if level == "sequence":
            log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
        w = torch.exp(log_ratio.clamp(max=math.log(cap)))
        return torch.where(valid, w, torch.zeros_like(w))


def sparse_rl_rejection(
    learner_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    cap: float,
    token_ratio_low: float,
    token_ratio_high: float,
    veto_threshold: float,
    seq_ratio_max: float | None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Sparse-RL's sparsity-aware rejection and importance reweighting, before batch normalisation.

    Source: Sparse-RL (arXiv 2601.10079) as its official code runs it (lsjia/Sparse-RL, slime's masked
    importance sampling `mis` with the configuration of its R-KV runs). With the per-token ratio
    xi_t = pi_dense(o_t) / pi_rollout(o_t) = exp(learner_logp_t - rollout_logp_t):
      - veto: a sequence holding a valid token with xi_t < veto_threshold (1e-4) is dropped whole (0 = off);
      - token mask: a token with xi_t outside [token_ratio_low, token_ratio_high] ([0.5, 1.5]) is masked out;
      - optional, off by default (verl's `geometric` mode, not in the official configuration): a sequence whose
        geometric-mean ratio exp(mean_t log xi_t) lies outside [1/seq_ratio_max, seq_ratio_max] is dropped;
      - weight: w_t = min(xi_t, cap) (cap 1.5) on the kept tokens, 0 elsewhere.
    The batch normalisation (weights / their mean over the kept tokens of the whole mini-batch) is the caller's
    (`sparse_rl_loss`, with the mean from `sparse_rl_weight_sums` when the mini-batch is split).

    Returns (keep [B, T] bool: the valid tokens that stay in the loss, weights [B, T] detached (0 where not
    kept), stats): rejection/seq_fraction = sequences with valid tokens but none kept / sequences with valid
    tokens; rejection/token_fraction = valid tokens not kept / valid tokens (0 when there is none).
    """
    _same_shape("rollout_logp", rollout_logp, learner_logp, "learner_logp")
    valid = _valid(mask, learner_logp)
    if not cap > 0:
        raise SmdInputError(f"sparse_rl importance-weight cap must be > 0, got {cap}")
    if not 0 <= token_ratio_low <= 1 <= token_ratio_high:
        raise SmdInputError(
            f"sparse_rl token window: need 0 <= low <= 1 <= high, got [{token_ratio_low}, {token_ratio_high}]"
        )
    if not 0 <= veto_threshold <= 1:
        raise SmdInputError(f"sparse_rl veto_threshold must be in [0, 1], got {veto_threshold}")
    if seq_ratio_max is not None and not seq_ratio_max >= 1:
        raise SmdInputError(f"sparse_rl seq_ratio_max must be >= 1 (or None = off), got {seq_ratio_max}")
    with torch.no_grad():
        d = torch.where(
            valid,
            learner_logp.double() - rollout_logp.double(),
            torch.zeros((), dtype=torch.float64, device=learner_logp.device),
        )
        seq_keep = torch.ones(valid.shape[:-1], dtype=torch.bool, device=valid.device)
        if veto_threshold > 0:
            seq_keep &= ~((d < math.log(veto_threshold)) & valid).any(dim=-1)
        if seq_ratio_max is not None:
            mean_d = d.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)
            seq_keep &= mean_d.abs() <= math.log(seq_ratio_max)
        keep = valid & seq_keep.unsqueeze(-1)
        if token_ratio_low > 0:
            keep &= d >= math.log(token_ratio_low)
        keep &= d <= math.log(token_ratio_high)
        w = torch.exp(d.clamp(max=math.log(cap))).to(torch.float32)
        weights = torch.where(keep, w, torch.zeros_like(w))
        stats = rejection_fractions(valid.sum(dim=-1).cpu(), keep.sum(dim=-1).cpu())
    return keep, weights, stats


def rejection_fractions(tokens: Any, kept: Any) -> dict[str, float]:
    """sparse_rl's rejected fractions from per-sequence counts (`tokens [B]` valid tokens, `kept [B]` those kept;
    numpy arrays or host tensors): rejection/seq_fraction = sequences with valid tokens but none kept / sequences
    with valid tokens; rejection/token_fraction = valid tokens not kept / valid tokens (0 when there is none)."""
    tokens, kept = np.asarray(tokens, dtype=np.float64), np.asarray(kept, dtype=np.float64)
    n_seq, n_tok = int((tokens > 0).sum()), int(tokens.sum())
    return {"rejection/seq_fraction": float(((tokens > 0) & (kept == 0)).sum() / n_seq) if n_seq else 0.0,
            "rejection/token_fraction": float(1.0 - kept.sum() / n_tok) if n_tok else 0.0}


def sparse_rl_weight_sums(keep: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Per sequence: (number of kept tokens [B], sum of their truncated weights [B]) of `sparse_rl_rejection`'s
    (keep, weights). The mean weight of a mini-batch = sum of the weight sums / sum of the kept counts over its
    rows: the learner computes it from the proximal log-probs before the first update, so that every
    micro-batch normalises by the whole mini-batch's mean (as the official code normalises over the batch)."""
    return keep.sum(dim=-1), weights.double().sum(dim=-1)


def sparse_rl_rules(params: LearnerParams) -> dict[str, Any]:
    """`sparse_rl_rejection`'s keyword arguments from the `learner:` section (the one place they are mapped)."""
    return {
        "cap": params.sparse_rl_is_cap,
        "token_ratio_low": params.sparse_rl_token_ratio_low,
        "token_ratio_high": params.sparse_rl_token_ratio_high,
        "veto_threshold": params.sparse_rl_veto_threshold,
        "seq_ratio_max": params.sparse_rl_seq_ratio_max,
    }


def loss_agg_for(params: LearnerParams) -> str:
    """The aggregation an objective runs with: `sparse_rl_loss_agg` for sparse_rl (the official per-sequence
    token mean by default), `released_loss_agg` for smd_released (the released code's per-sequence mean by
    default), else `loss_agg`."""
    if params.objective == "sparse_rl" and params.sparse_rl_loss_agg is not None:
        return params.sparse_rl_loss_agg
    if params.objective == "smd_released" and params.released_loss_agg is not None:
        return params.released_loss_agg
    return params.loss_agg


# ---------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class ObjectiveBatch:
    """The tensors of one (micro-)batch an objective reads (`[B]` / `[B, T]`, see the conventions above).

      advantages     [B] group advantages (`group_advantages`), detached here.
      mask           [B, T] valid response tokens.
      rollout_logp   [B, T] log-probs the sparse rollout recorded (the behaviour policy).
      masked_logp    [B, T] learner log-probs under the shadow mask (with grad): objectives with masked_forward.
      dense_logp     [B, T] learner log-probs with the full context (with grad): the others.
      kl_per_token   [B, T] KL(sg[pi_dense] || pi_masked) per response token (with gradient), computed from the
                     hidden states in token chunks (`stages.learner.logprobs.chunked_token_scores`): smd's teacher
                     term (needed when kl_lambda > 0); for smd at kl_lambda 0 and shadow only logged.
      kl_mask        [B, T] the tokens the KL applies to (`learner.kl_tokens`, `stages.learner.kl_tokens`), within
                     `mask`; None = every valid token (`all`, the paper). The KL is aggregated (`loss_agg`) over
                     mask & kl_mask only: token_mean = its mean over the selected tokens, 0 when there is none.
      old_logp       [B, T] proximal policy for the ratio; None = the spec's `old_logp`: the rollout's log-probs,
                     or the policy log-probs detached ("recomputed": ratio 1). The learner passes the parity
                     pass's log-probs for "recomputed", the reference across several updates per batch.
      ref_logp       [B, T] reference-policy log-probs, needed when ref_kl_coef > 0.
      sparse_rl_rejection  (keep [B, T] bool, truncated weights [B, T]) fixed before the first update (the learner's
                     `RowWeights`); None = `sparse_rl_rejection` of old_logp here (its rejection/* then in terms).
      sparse_rl_weight_mean  sparse_rl's batch-normalisation constant, the mean weight over the kept tokens of the
                     whole mini-batch; None = this batch's (the batch is the mini-batch).
      trusted_mask   [B, T] smd_released's trusted tokens (`stages.learner.released`): the valid ones whose shadow-
                     mask visibility is <= retention + margin; the policy term's numerator runs over them only.
    """

    advantages: Tensor
    mask: Tensor
    rollout_logp: Tensor
    masked_logp: Tensor | None = None
    dense_logp: Tensor | None = None
    kl_per_token: Tensor | None = None
    kl_mask: Tensor | None = None
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    sparse_rl_rejection: tuple[Tensor, Tensor] | None = None
    sparse_rl_weight_mean: float | None = None
    trusted_mask: Tensor | None = None


ObjectiveFn = Callable[[LearnerParams, ObjectiveBatch], tuple[Tensor, dict[str, float]]]


@dataclass(frozen=True)
class ObjectiveSpec:
    """What the learner runs for an objective, registered with its function (the one table of these facts).

    masked_forward: the policy log-probs come from the shadow-masked forward (the compacted mask store is read,
                    the parity gate applies); else from the dense forward.
    old_logp:       the proximal old policy: "rollout" = the rollout's log-probs; "recomputed" = the learner's own
                    before the first update (the parity pass's log-probs).
    row_weights:    token weights of the policy term: "none"; "tis" = truncated importance weights per
                    micro-batch; "sparse_rl" = rejection and weights fixed per row before the first update (the
                    learner's `RowWeights`: they also set the micro-batch shares and the normalisation).
    dense_teacher:  adds kl_lambda * KL(sg[pi_dense] || pi_masked): with kl_lambda > 0 the learner runs the dense
                    teacher beside the masked policy.
    token_filter:   "none"; "visibility" = the learner reads the compacted mask store (without a masked forward) and
                    hands the objective smd_released's trusted tokens (`ObjectiveBatch.trusted_mask`).
    """

    name: str
    fn: ObjectiveFn
    masked_forward: bool
    old_logp: Literal["rollout", "recomputed"]
    row_weights: Literal["none", "tis", "sparse_rl"] = "none"
    dense_teacher: bool = False
    token_filter: Literal["none", "visibility"] = "none"

    @property
    def needs_masks(self) -> bool:
        """Whether the learner reads the compacted mask store (the shadow-masked forward or the token filter)."""
        return self.masked_forward or self.token_filter != "none"


OBJECTIVE_REGISTRY: dict[str, ObjectiveSpec] = {}


def register_objective(
    name: str,
    *,
    masked_forward: bool,
    old_logp: Literal["rollout", "recomputed"],
    row_weights: Literal["none", "tis", "sparse_rl"] = "none",
    dense_teacher: bool = False,
    token_filter: Literal["none", "visibility"] = "none",
) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Decorator: register `fn(params, batch) -> (loss, terms)` as objective `name` (one of the `learner.objective`
    choices) with its `ObjectiveSpec`. A name registered twice raises ValueError."""

    def decorator(fn: ObjectiveFn) -> ObjectiveFn:
        if name in OBJECTIVE_REGISTRY:
            raise ValueError(f"objective {name!r} is already registered ({OBJECTIVE_REGISTRY[name].fn.__name__})")
        if name not in OBJECTIVES:
            raise ValueError(f"objective {name!r} is not a learner.objective choice ({', '.join(OBJECTIVES)})")
        OBJECTIVE_REGISTRY[name] = ObjectiveSpec(name=name, fn=fn, masked_forward=masked_forward, old_logp=old_logp,
                                                 row_weights=row_weights, dense_teacher=dense_teacher,
                                                 token_filter=token_filter)
        return fn

    return decorator


def objective_spec(name: str) -> ObjectiveSpec:
    """The registered spec of objective `name`; SmdInputError for an unknown one."""
    _check_choice("objective", name, tuple(OBJECTIVE_REGISTRY))
    return OBJECTIVE_REGISTRY[name]


def objective_loss(params: LearnerParams, batch: ObjectiveBatch) -> tuple[Tensor, dict[str, float]]:
    """The objective `params.objective` of docs/design.md on `batch`. Returns (total loss to backpropagate, terms
    for logging: `LOSS_TERMS`, the pg/* stats, and is_weight/mean for tis/sparse_rl, rejection/* for sparse_rl
    when it computed the rejection itself). total = loss/pg + kl_lambda * loss/kl_dense (smd only) +
    ref_kl_coef * loss/kl_ref. A params object built in code (`model_copy`) skips pydantic, so the two weights
    whose sign would silently flip the objective are checked here too."""
    spec = objective_spec(params.objective)
    if not params.kl_lambda >= 0:
        raise SmdInputError(f"kl_lambda must be >= 0, got {params.kl_lambda}")
    if not params.ref_kl_coef >= 0:
        raise SmdInputError(f"ref_kl_coef must be >= 0, got {params.ref_kl_coef}")
    return spec.fn(params, batch)


# ------------------------------------------------------------------------------- pieces of the objectives
def _need(objective: str, **tensors: Tensor | None) -> None:
    missing = [name for name, t in tensors.items() if t is None]
    if missing:
        raise SmdInputError(f"objective {objective!r} needs {', '.join(missing)}")


def _policy_inputs(name: str, batch: ObjectiveBatch) -> tuple[Tensor, Tensor, Tensor]:
    """(policy log-probs, proximal old log-probs, valid mask) of `batch` for objective `name`, per its spec."""
    spec = OBJECTIVE_REGISTRY[name]
    valid = _valid(batch.mask, batch.rollout_logp)
    field = "masked_logp" if spec.masked_forward else "dense_logp"
    logp = getattr(batch, field)
    _need(name, **{field: logp})
    _same_shape("learner logp", logp, batch.rollout_logp, "rollout_logp")
    if batch.old_logp is not None:
        old = batch.old_logp
    else:
        old = batch.rollout_logp if spec.old_logp == "rollout" else logp.detach()
    return logp, old, valid


def _clipped_pg(params: LearnerParams, logp: Tensor, old: Tensor, batch: ObjectiveBatch, valid: Tensor,
                token_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    return policy_loss(logp, old, batch.advantages, valid, clip_eps_low=params.clip_eps_low,
                       clip_eps_high=params.clip_eps_high, loss_agg=loss_agg_for(params),
                       token_weights=token_weights, dual_clip_c=params.dual_clip_c)


def _kl_valid(batch: ObjectiveBatch, valid: Tensor) -> Tensor:
    """The tokens the dense-teacher KL is aggregated over: the valid ones, within `kl_mask` when given."""
    if batch.kl_mask is None:
        return valid
    return valid & _valid(batch.kl_mask, valid, "kl_mask")


def _teacher_kl(name: str, batch: ObjectiveBatch, valid: Tensor, loss_agg: str) -> Tensor:
    _need(name, kl_per_token=batch.kl_per_token)
    _same_shape("kl_per_token", batch.kl_per_token, batch.rollout_logp, "rollout_logp")
    return aggregate(batch.kl_per_token, _kl_valid(batch, valid), loss_agg)


def _logged_teacher_kl(batch: ObjectiveBatch, valid: Tensor, loss_agg: str) -> float:
    """The dense-teacher KL when given, logged only (no gradient); 0 without it."""
    if batch.kl_per_token is None:
        return 0.0
    return float(aggregate(batch.kl_per_token.detach(), _kl_valid(batch, valid), loss_agg))


def _finish(name: str, params: LearnerParams, batch: ObjectiveBatch, logp: Tensor, valid: Tensor, pg: Tensor,
            total: Tensor, stats: dict[str, float], kl_dense: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """Add the reference KL (ref_kl_coef > 0) to `total`; the terms under their logged names."""
    kl_ref_value = 0.0
    if params.ref_kl_coef > 0:
        _need(f"{name} with ref_kl_coef > 0", ref_logp=batch.ref_logp)
        kl_ref = reference_kl(logp, batch.ref_logp, valid, kind=params.ref_kl_kind, loss_agg=loss_agg_for(params))
        total = total + params.ref_kl_coef * kl_ref
        kl_ref_value = float(kl_ref.detach())
    values = (float(pg.detach()), kl_dense, kl_ref_value, float(total.detach()))
    return total, {**dict(zip(LOSS_TERMS, values)), **stats}


def _weighted(name: str, params: LearnerParams, batch: ObjectiveBatch, logp: Tensor, old: Tensor, valid: Tensor,
              token_weights: Tensor, extra: dict[str, float]) -> tuple[Tensor, dict[str, float]]:
    """The dense learner's policy term with importance weights `token_weights` over `valid` (+ is_weight/mean)."""
    mean_w = float(token_weights[valid].mean()) if bool(valid.any()) else 0.0
    pg, stats = _clipped_pg(params, logp, old, batch, valid, token_weights)
    return _finish(name, params, batch, logp, valid, pg, pg, {**stats, **extra, "is_weight/mean": mean_w})


# ------------------------------------------------------------------------------------------- objectives
@register_objective("smd", masked_forward=True, old_logp="rollout", dense_teacher=True)
def smd_loss(params: LearnerParams, batch: ObjectiveBatch) -> tuple[Tensor, dict[str, float]]:
    """GRPO on the shadow-masked policy (old = the rollout) + kl_lambda * KL(sg[pi_dense] || pi_masked), the KL
    over the valid tokens within `batch.kl_mask` (`learner.kl_tokens`; all of them when None)."""
    logp, old, valid = _policy_inputs("smd", batch)
    pg, stats = _clipped_pg(params, logp, old, batch, valid)
    agg = loss_agg_for(params)
    if params.kl_lambda > 0:
        kl = _teacher_kl("smd", batch, valid, agg)
        return _finish("smd", params, batch, logp, valid, pg, pg + params.kl_lambda * kl, stats, float(kl.detach()))
    return _finish("smd", params, batch, logp, valid, pg, pg, stats, _logged_teacher_kl(batch, valid, agg))


@register_objective("shadow", masked_forward=True, old_logp="rollout")
def shadow_loss(params: LearnerParams, batch: ObjectiveBatch) -> tuple[Tensor, dict[str, float]]:
    """smd without the teacher term (kl_lambda ignored; the teacher KL is logged when given)."""
    logp, old, valid = _policy_inputs("shadow", batch)
    pg, stats = _clipped_pg(params, logp, old, batch, valid)
    return _finish("shadow", params, batch, logp, valid, pg, pg, stats,
                   _logged_teacher_kl(batch, valid, loss_agg_for(params)))


def _dense_pg(name: str, params: LearnerParams, batch: ObjectiveBatch) -> tuple[Tensor, dict[str, float]]:
    logp, old, valid = _policy_inputs(name, batch)
    pg, stats = _clipped_pg(params, logp, old, batch, valid)
    return _finish(name, params, batch, logp, valid, pg, pg, stats)


@register_objective("naive", masked_forward=False, old_logp="recomputed")
def naive_loss(params: LearnerParams, batch: ObjectiveBatch) -> tuple[Tensor, dict[str, float]]:
    """GRPO on the dense learner, old = its own log-probs before the update; the rollout mismatch ignored."""
    return _dense_pg("naive", params, batch)


@register_objective("naive_bypass", masked_forward=False, old_logp="rollout")
def naive_bypass_loss(params: LearnerParams, batch: ObjectiveBatch) -> tuple[Tensor, dict[str, float]]:
    """GRPO on the dense learner, old = the sparse rollout's log-probs (verl's bypass of the recomputation)."""
    return _dense_pg("naive_bypass", params, batch)


@register_objective("dense", masked_forward=False, old_logp="rollout")
def dense_loss(params: LearnerParams, batch: ObjectiveBatch) -> tuple[Tensor, dict[str, float]]:
    """naive_bypass's rule, named for dense rollouts (the rollout's and the learner's log-probs coincide)."""
    return _dense_pg("dense", params, batch)


@register_objective("tis", masked_forward=False, old_logp="recomputed", row_weights="tis")
def tis_loss(params: LearnerParams, batch: ObjectiveBatch) -> tuple[Tensor, dict[str, float]]:
    """The dense learner with verl's decoupled truncated importance weights min(pi_old / pi_rollout, tis_cap)."""
    logp, old, valid = _policy_inputs("tis", batch)
    weights = tis_weights(old, batch.rollout_logp, valid, level=params.tis_level, cap=params.tis_cap)
    return _weighted("tis", params, batch, logp, old, valid, weights, {})


@register_objective("sparse_rl", masked_forward=False, old_logp="recomputed", row_weights="sparse_rl")
def sparse_rl_loss(params: LearnerParams, batch: ObjectiveBatch) -> tuple[Tensor, dict[str, float]]:
    """Sparse-RL: the dense learner over the kept tokens (`sparse_rl_rejection` of old vs rollout, or the batch's
    fixed one), weighted by the truncated ratios divided by their mean over the mini-batch's kept tokens
    (sparse_rl_batch_normalize); `loss_agg_for` (the official per-sequence token mean by default)."""
    logp, old, valid = _policy_inputs("sparse_rl", batch)
    extra: dict[str, float] = {}
    if batch.sparse_rl_rejection is not None:
        keep, weights = batch.sparse_rl_rejection
        _same_shape("sparse_rl keep", keep, logp, "logp")
    else:
        keep, weights, extra = sparse_rl_rejection(old, batch.rollout_logp, valid, **sparse_rl_rules(params))
    if params.sparse_rl_batch_normalize:
        mean = batch.sparse_rl_weight_mean
        if mean is None:
            mean = float(weights[keep].double().mean()) if bool(keep.any()) else 1.0
        if not mean > 0:
            raise SmdInputError(f"sparse_rl_weight_mean must be > 0, got {mean}")
        weights = weights / mean
    return _weighted("sparse_rl", params, batch, logp, old, keep, weights, extra)


@register_objective("smd_released", masked_forward=False, old_logp="recomputed", token_filter="visibility")
def smd_released_loss(params: LearnerParams, batch: ObjectiveBatch) -> tuple[Tensor, dict[str, float]]:
    """The rule of the SMD authors' released code, huthvincent/RL-Post-Training-with-KV-Cache-Compression, commit
    26029e8bf9d5140ee8948cbc645d8b3414bbc994, SMD/src/shadow_distillation_loss.py (`shadow_distillation_loss_function`,
    run by slime as a custom loss over one dense Megatron forward):

      pg   = sum_of_sample_mean(max(-A r, -A clip(r, 1 - eps, 1 + eps)) * trusted), r = exp(dense_logp - old_logp),
             old = slime's recomputed log-probs (`batch["log_probs"]`: no --use-rollout-logprobs in any released
             script), `trusted` = visibility <= retention + 0.05 (`stages.learner.released`);
      kl   = sum_of_sample_mean(clamp(rollout_logp - dense_logp, min=0)) over every valid token (no filter);
      loss = pg + kl_lambda * kl,

    sum_of_sample_mean (slime, cp_utils.get_sum_of_sample_mean; the loss then x num_microbatches / global batch) =
    the mean over sequences of (sum over the sequence's valid tokens / its valid tokens): `released_loss_agg`
    (seq_mean_token_mean), the trusted filter in the numerator only, as the file multiplies the per-token loss by
    it before that reduction. No dual clip (`policy_loss(dual_clip_c=None)`); clip range clip_eps_low / high (the
    file's symmetric --eps-clip 0.2 = the defaults). Left out: the file's `- entropy_coef * entropy` (slime's
    entropy bonus, 0 by default, 0.01 in the released scripts): no smd objective has an entropy bonus and the
    learner's entropy carries no gradient. Logged: `released/trusted_fraction` (per-sequence mean)."""
    logp, old, valid = _policy_inputs("smd_released", batch)
    _need("smd_released", trusted_mask=batch.trusted_mask)
    trusted = valid & _valid(batch.trusted_mask, valid, "trusted_mask")
    agg = loss_agg_for(params)
    pg, stats = policy_loss(logp, old, batch.advantages, valid, clip_eps_low=params.clip_eps_low,
                            clip_eps_high=params.clip_eps_high, loss_agg=agg, token_weights=trusted.to(logp.dtype),
                            dual_clip_c=None)
    stats[TRUSTED_FRACTION] = float(aggregate(trusted.to(torch.float64), valid, agg))
    if params.kl_lambda > 0:
        distill = aggregate(one_sided_distillation_per_token(batch.rollout_logp, logp), valid, agg)
        return _finish("smd_released", params, batch, logp, valid, pg, pg + params.kl_lambda * distill, stats,
                       float(distill.detach()))
    with torch.no_grad():
        logged = float(aggregate(one_sided_distillation_per_token(batch.rollout_logp, logp), valid, agg))
    return _finish("smd_released", params, batch, logp, valid, pg, pg, stats, logged)
