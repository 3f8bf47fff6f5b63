"""The learner's objective math: small pure torch functions.

Conventions (every function):
- Per-token tensors are padded `[B, T]` over the response tokens; `mask` (bool, or float 0/1) marks the valid
  ones. Padded positions never reach a result, even if they hold NaN or inf (selected out with `where`).
- `logp` tensors are log-probabilities of the sampled tokens under the sampling distribution, i.e.
  `log_softmax(logits / temperature)` gathered at the token (see `token_logprobs`).
- Losses are minimised. Everything that is a target (old/rollout/reference log-probs, advantages, importance
  weights, the dense teacher) is detached inside the function, so a caller that forgot `no_grad` cannot leak
  gradient into it.

Objectives (docs/design.md), `objective_loss` composes them:
- smd:       pg(masked_logp vs rollout_logp) + kl_lambda * KL(sg[pi_dense] || pi_masked)
- shadow:    pg(masked_logp vs rollout_logp)                     (no dense pass)
- dense:     pg(dense_logp vs rollout_logp)                      (naive: ignores the context mismatch)
- tis:       pg(dense_logp vs old_logp) * min(pi_old / pi_rollout, C)        (truncated IS, verl-style)
- sparse_rl: pg over kept sequences * min(pi_old / pi_rollout, C)            (rejection + reweighting)
plus `ref_kl_coef * KL(pi || pi_ref)` when a reference is configured.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from schemas.errors import SmdInputError
from schemas.params.learner import LOSS_AGGS, OBJECTIVES, REF_KL_KINDS, TIS_LEVELS, LearnerParams

__all__ = [
    "OBJECTIVES",
    "LOSS_AGGS",
    "token_logprobs",
    "aggregate",
    "group_advantages",
    "policy_loss",
    "dense_teacher_kl_per_token",
    "dense_teacher_kl",
    "reference_kl",
    "tis_weights",
    "sparse_rl_rejection",
    "objective_loss",
    "objective_kwargs",
    "token_entropy",
    "zero_advantage_group_fraction",
]

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


def aggregate(values: Tensor, mask: Tensor, loss_agg: str = "token_mean") -> Tensor:
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
    n_groups = int(inverse.max()) + 1
    r = rewards.detach().double()
    gmax = torch.full((n_groups,), -math.inf, dtype=torch.float64).scatter_reduce_(0, inverse, r, "amax")
    gmin = torch.full((n_groups,), math.inf, dtype=torch.float64).scatter_reduce_(0, inverse, r, "amin")
    return float((gmax == gmin).double().mean())


# ------------------------------------------------------------------------------------------- advantages
def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    group_size: int | None = None,
    eps: float = 1e-6,
    scale: str = "std",
) -> Tensor:
    """GRPO group-normalised advantages, `[N] -> [N]` (dtype of `rewards`, float32 for integer rewards).

    Groups come from `group_ids [N]` (any integer labels), or `group_size` (consecutive rows).
    scale="std":  (r - mean_g) / (std_g + eps), std_g the unbiased (Bessel) group std, as TRL and verl.
    scale="none": r - mean_g (Dr. GRPO).
    A group whose rewards are all equal, and a group of one, gets exactly 0 (no contrast, no signal).
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
    r = rewards.detach().double()
    n_groups = int(inverse.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )
    total = torch.zeros_like(count).index_add_(0, inverse, r)
    mean = (total / count)[inverse]
    centred = r - mean
    if scale == "std":
        sq = torch.zeros_like(count).index_add_(0, inverse, centred * centred)
        std = torch.sqrt(sq / (count - 1).clamp(min=1))[inverse]
        centred = centred / (std + eps)
    # Exact zeros for constant groups (r - mean may be 1e-17 off in floating point) and singletons.
    gmax = torch.full_like(count, -math.inf).scatter_reduce_(0, inverse, r, "amax")
    gmin = torch.full_like(count, math.inf).scatter_reduce_(0, inverse, r, "amin")
    flat = ((gmax == gmin) | (count < 2))[inverse]
    centred = torch.where(flat, torch.zeros_like(centred), centred)
    return centred.to(out_dtype)


# ---------------------------------------------------------------------------------------- policy loss
def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    loss_agg: str = "token_mean",
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO/GRPO clipped surrogate. Returns (loss, stats).

    ratio_t = exp(logp_t - old_logp_t) (log-ratio clamped to +-20 against overflow);
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - clip_eps_low, 1 + clip_eps_high) * A) * w_t,
    with A = advantages[b] broadcast over the sequence and w_t = token_weights (1 if None; detached),
    reduced by `aggregate(loss_agg)`. Default clip is symmetric 0.2 (PPO/GRPO); DAPO's clip-higher sets
    clip_eps_high=0.28. Where the clipped branch is active the token gets no gradient.

    stats (python floats, over valid tokens): pg/clipfrac (fraction of tokens on the clipped branch),
    pg/ratio_mean, pg/ratio_min, pg/ratio_max, pg/approx_kl (mean of old_logp - logp).
    """
    _same_shape("old_logp", old_logp, logp, "logp")
    valid = _valid(mask, logp)
    if advantages.shape != logp.shape[:1]:
        raise SmdInputError(f"advantages: expected shape [{logp.shape[0]}], got {tuple(advantages.shape)}")
    if not (0 < clip_eps_low < 1) or clip_eps_high <= 0:
        raise SmdInputError(
            f"clip range: need 0 < clip_eps_low < 1 and clip_eps_high > 0, got {clip_eps_low}, {clip_eps_high}"
        )
    log_ratio = (logp - old_logp.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(ratio.dtype).unsqueeze(-1)
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    per_token = -torch.minimum(surr, surr_clipped)
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
                "pg/ratio_mean": float(r.mean()),
                "pg/ratio_min": float(r.min()),
                "pg/ratio_max": float(r.max()),
                "pg/approx_kl": float((-log_ratio)[valid].mean()),
            }
        else:
            stats = {
                "pg/clipfrac": 0.0,
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
    loss_agg: str = "token_mean",
) -> Tensor:
    """`dense_teacher_kl_per_token` reduced over the valid response tokens with `aggregate(loss_agg)`."""
    per_token = dense_teacher_kl_per_token(masked_logits, dense_logits, temperature)
    return aggregate(per_token, _valid(mask, per_token), loss_agg)


def reference_kl_per_token(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
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
    logp: Tensor, ref_logp: Tensor, mask: Tensor, *, kind: str = "k3", loss_agg: str = "token_mean"
) -> Tensor:
    """`reference_kl_per_token` reduced over the valid tokens with `aggregate(loss_agg)`."""
    per_token = reference_kl_per_token(logp, ref_logp, kind)
    return aggregate(per_token, _valid(mask, logp), loss_agg)


# ----------------------------------------------------------------------------- off-policy corrections
def tis_weights(
    learner_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    cap: float = 2.0,
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
    seq_ratio_max: float = 2.0,
    token_ratio_min: float = 0.01,
    cap: float = 2.0,
) -> tuple[Tensor, Tensor, float]:
    """Sparse-RL: sparsity-aware rejection sampling + importance-based token reweighting.

    With the per-token ratio xi_t = pi_dense(o_t) / pi_rollout(o_t) = exp(learner_logp_t - rollout_logp_t)
    (learner = dense context, rollout = sparse sampler), a sequence is REJECTED when
      (a) its geometric-mean ratio exp(mean_t log xi_t) lies outside [1/seq_ratio_max, seq_ratio_max], i.e.
          |mean_t log xi_t| > log(seq_ratio_max)  (the whole trajectory drifted), or
      (b) some valid token has xi_t < token_ratio_min (the sparse sampler produced a token the dense policy
          deems implausible: an anomalous trajectory). token_ratio_min = 0 disables (b).
    A sequence with no valid token is kept (nothing to judge; it contributes nothing).
    Kept sequences get truncated token IS weights min(xi_t, cap); rejected ones and padding get 0.

    Returns (keep [B] bool, token_weights [B, T] detached, rejected fraction of the B sequences).
    """
    _same_shape("rollout_logp", rollout_logp, learner_logp, "learner_logp")
    valid = _valid(mask, learner_logp)
    if not seq_ratio_max >= 1:
        raise SmdInputError(f"sparse_rl seq_ratio_max must be >= 1, got {seq_ratio_max}")
    if not 0 <= token_ratio_min <= 1:
        raise SmdInputError(f"sparse_rl token_ratio_min must be in [0, 1], got {token_ratio_min}")
    with torch.no_grad():
        d = torch.where(
            valid,
            learner_logp.float() - rollout_logp.float(),
            torch.zeros_like(learner_logp, dtype=torch.float32),
        )
        mean_d = d.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)
        keep = mean_d.abs() <= math.log(seq_ratio_max)
        if token_ratio_min > 0:
            keep &= ~((d < math.log(token_ratio_min)) & valid).any(dim=-1)
        weights = tis_weights(learner_logp, rollout_logp, valid, level="token", cap=cap)
        weights = weights * keep.unsqueeze(-1).to(weights.dtype)
        rejected = float((~keep).float().mean()) if keep.numel() else 0.0
    return keep, weights, rejected


# ------------------------------------------------------------------------------------------ composition
def _need(objective: str, **tensors: Tensor | None) -> None:
    missing = [name for name, t in tensors.items() if t is None]
    if missing:
        raise SmdInputError(f"objective {objective!r} needs {', '.join(missing)}")


def objective_loss(
    objective: str,
    *,
    advantages: Tensor,
    mask: Tensor,
    rollout_logp: Tensor,
    masked_logp: Tensor | None = None,
    dense_logp: Tensor | None = None,
    masked_logits: Tensor | None = None,
    dense_logits: Tensor | None = None,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    kl_lambda: float = 0.1,
    temperature: float = 1.0,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    loss_agg: str = "token_mean",
    ref_kl_coef: float = 0.0,
    ref_kl_kind: str = "k3",
    tis_level: str = "token",
    tis_cap: float = 2.0,
    sparse_rl_seq_ratio_max: float = 2.0,
    sparse_rl_token_ratio_min: float = 0.01,
) -> tuple[Tensor, dict[str, float]]:
    """One objective of docs/design.md. Returns (total loss to backpropagate, terms for logging).

    Inputs ([B] / [B, T] / [B, T, V]):
      advantages     [B] group advantages (`group_advantages`), detached here.
      mask           [B, T] valid response tokens.
      rollout_logp   [B, T] log-probs the sparse rollout recorded (the behaviour policy).
      masked_logp    [B, T] learner log-probs under the shadow mask (with grad) - smd, shadow.
      dense_logp     [B, T] learner log-probs with the full context (with grad) - dense, tis, sparse_rl.
      masked_logits, dense_logits [B, T, V] response-position logits (before temperature) - smd with
                     kl_lambda > 0. The dense ones are detached here. For shadow they are optional and only
                     logged.
      old_logp       [B, T] proximal policy for the ratio. Default: rollout_logp for smd/shadow/dense (the
                     shadow policy *is* the rollout policy; the naive dense baseline pretends so);
                     dense_logp.detach() for tis/sparse_rl (their IS weights correct old -> rollout). With
                     several updates per batch pass the first pass's detached logp.
      ref_logp       [B, T] reference-policy log-probs, needed when ref_kl_coef > 0.
    Loss: total = pg_loss + kl_lambda * kl_dense (smd only) + ref_kl_coef * kl_ref.
    terms: pg_loss, kl_dense, kl_ref, total (python floats) plus pg/* stats, and for tis/sparse_rl
    is_weight/mean and rejection/seq_fraction.
    """
    _check_choice("objective", objective, OBJECTIVES)
    if not kl_lambda >= 0:
        raise SmdInputError(f"kl_lambda must be >= 0, got {kl_lambda}")
    if not ref_kl_coef >= 0:
        raise SmdInputError(f"ref_kl_coef must be >= 0, got {ref_kl_coef}")
    valid = _valid(mask, rollout_logp)

    token_weights: Tensor | None = None
    extra: dict[str, float] = {}
    if objective in ("smd", "shadow"):
        _need(objective, masked_logp=masked_logp)
        logp = masked_logp
        old = rollout_logp if old_logp is None else old_logp
    else:
        _need(objective, dense_logp=dense_logp)
        logp = dense_logp
        if objective == "dense":
            old = rollout_logp if old_logp is None else old_logp
        else:
            old = dense_logp.detach() if old_logp is None else old_logp
            if objective == "tis":
                token_weights = tis_weights(old, rollout_logp, valid, level=tis_level, cap=tis_cap)
                extra["rejection/seq_fraction"] = 0.0
            else:
                keep, token_weights, rejected = sparse_rl_rejection(
                    old,
                    rollout_logp,
                    valid,
                    seq_ratio_max=sparse_rl_seq_ratio_max,
                    token_ratio_min=sparse_rl_token_ratio_min,
                    cap=tis_cap,
                )
                valid = valid & keep.unsqueeze(-1)
                extra["rejection/seq_fraction"] = rejected
            n = int(valid.sum())
            extra["is_weight/mean"] = float(token_weights[valid].mean()) if n else 0.0
    assert logp is not None
    _same_shape("learner logp", logp, rollout_logp, "rollout_logp")

    pg, stats = policy_loss(
        logp,
        old,
        advantages,
        valid,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        loss_agg=loss_agg,
        token_weights=token_weights,
    )
    total = pg

    kl_dense_value = 0.0
    if objective == "smd" and kl_lambda > 0:
        _need(objective, masked_logits=masked_logits, dense_logits=dense_logits)
        kl_dense = dense_teacher_kl(
            masked_logits, dense_logits, valid, temperature=temperature, loss_agg=loss_agg
        )
        total = total + kl_lambda * kl_dense
        kl_dense_value = float(kl_dense.detach())
    elif objective in ("smd", "shadow") and masked_logits is not None and dense_logits is not None:
        with torch.no_grad():  # logged only
            kl_dense_value = float(
                dense_teacher_kl(
                    masked_logits, dense_logits, valid, temperature=temperature, loss_agg=loss_agg
                )
            )

    kl_ref_value = 0.0
    if ref_kl_coef > 0:
        _need(f"{objective} with ref_kl_coef > 0", ref_logp=ref_logp)
        kl_ref = reference_kl(logp, ref_logp, valid, kind=ref_kl_kind, loss_agg=loss_agg)
        total = total + ref_kl_coef * kl_ref
        kl_ref_value = float(kl_ref.detach())

    terms = {
        "pg_loss": float(pg.detach()),
        "kl_dense": kl_dense_value,
        "kl_ref": kl_ref_value,
        "total": float(total.detach()),
        **stats,
        **extra,
    }
    return total, terms


def objective_kwargs(params: LearnerParams, temperature: float = 1.0) -> dict[str, Any]:
    """The hyperparameters of `objective_loss` from the `learner:` section (temperature from `rollout:`)."""
    return {
        "kl_lambda": params.kl_lambda,
        "temperature": temperature,
        "clip_eps_low": params.clip_eps_low,
        "clip_eps_high": params.clip_eps_high,
        "loss_agg": params.loss_agg,
        "ref_kl_coef": params.ref_kl_coef,
        "ref_kl_kind": params.ref_kl_kind,
        "tis_level": params.tis_level,
        "tis_cap": params.tis_cap,
        "sparse_rl_seq_ratio_max": params.sparse_rl_seq_ratio_max,
        "sparse_rl_token_ratio_min": params.sparse_rl_token_ratio_min,
    }
