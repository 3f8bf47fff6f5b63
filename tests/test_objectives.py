"""Objective math on tiny tensors against hand-computed values."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas.errors import SmdInputError
from schemas.params import load_params
from schemas.params.learner import OBJECTIVES, LearnerParams
from stages.bench.full_logits import full_logits_objective_loss
from stages.learner.objectives import (
    OBJECTIVE_REGISTRY,
    ObjectiveBatch,
    aggregate,
    dense_teacher_kl,
    dense_teacher_kl_per_token,
    group_advantages,
    loss_agg_for,
    objective_loss,
    objective_spec,
    policy_loss,
    reference_kl,
    register_objective,
    sparse_rl_rejection,
    sparse_rl_rules,
    sparse_rl_weight_sums,
    tis_weights,
    token_entropy,
    token_logprobs,
    zero_advantage_group_fraction,
)

LN = math.log
T = torch.tensor
# The symmetric PPO clip and token mean that the by-hand values of the policy-loss tests assume
PPO = {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "loss_agg": "token_mean"}
# Sparse-RL's official rules (learner defaults), from the params as the learner maps them
RULES = sparse_rl_rules(LearnerParams())


# ------------------------------------------------------------------------------------ group advantages
def test_equal_reward_group_is_exactly_zero_and_two_element_group_by_hand():
    rewards = T([0.1, 0.1, 0.1, 1.0, 0.0])
    adv = group_advantages(rewards, T([0, 0, 0, 1, 1]))
    assert torch.isfinite(adv).all()
    assert (adv[:3] == 0).all()  # exactly, although (0.1+0.1+0.1)/3 != 0.1 in floating point
    # group {1, 0}: mean 0.5, unbiased std sqrt(((0.5)^2 + (0.5)^2) / 1) = sqrt(0.5)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv[3].item() == pytest.approx(expected, rel=1e-6)
    assert adv[4].item() == pytest.approx(-expected, rel=1e-6)


def test_group_size_and_unordered_group_ids_agree():
    rewards = T([0.0, 1.0, 2.0, 5.0, 5.0, 5.0])
    by_size = group_advantages(rewards, group_size=3)
    # group [0, 1, 2]: mean 1, unbiased std 1
    assert by_size.tolist()[:3] == pytest.approx([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)])
    assert by_size.tolist()[3:] == [0.0, 0.0, 0.0]
    ids = T([9, 9, 9, 3, 3, 3])
    perm = T([3, 0, 5, 1, 4, 2])
    by_ids = group_advantages(rewards[perm], ids[perm])
    assert torch.allclose(by_ids, by_size[perm])


def test_advantage_scale_none_and_singletons():
    adv = group_advantages(T([1.0, 3.0, 7.0]), T([0, 0, 1]), scale="none")
    assert adv.tolist() == [-1.0, 1.0, 0.0]  # singleton group: no baseline, no signal


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_is_rejected(bad):
    with pytest.raises(SmdInputError, match="rewards: 1 non-finite"):
        group_advantages(T([1.0, bad]), group_size=2)


def test_group_arguments_are_validated():
    with pytest.raises(SmdInputError):
        group_advantages(T([1.0, 2.0, 3.0]), group_size=2)
    with pytest.raises(SmdInputError):
        group_advantages(T([1.0, 2.0]))
    with pytest.raises(SmdInputError):
        group_advantages(T([1.0, 2.0]), T([0, 0, 1]))
    with pytest.raises(SmdInputError):
        group_advantages(T([1.0, 2.0]), group_size=2, scale="rank")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.floats(-1e3, 1e3), min_size=4, max_size=12).filter(lambda xs: len(xs) % 2 == 0))
def test_advantages_are_finite_and_centred(values):
    adv = group_advantages(T(values, dtype=torch.float64), group_size=2)
    assert torch.isfinite(adv).all()
    # r - mean is exact up to a few ulps of |r|; dividing by (std + eps) >= eps can scale that rounding by 1/eps
    # (e.g. rewards 1000 and 1000 - 1e-13: std ~1e-13, so the group's sum is ~1e-7 instead of 0)
    bound = 1e-9 + 8 * torch.finfo(torch.float64).eps * max(abs(v) for v in values) / 1e-6
    assert adv.view(-1, 2).sum(-1).abs().max() < bound


# ---------------------------------------------------------------------------------------- policy loss
def test_clipping_region_values_and_gradients():
    # one token per sequence, old_logp = 0, so ratio = exp(logp)
    logp = T([[LN(1.5)], [LN(1.5)], [LN(0.5)], [LN(0.5)]], requires_grad=True)
    adv = T([1.0, -1.0, 1.0, -1.0])
    loss, stats = policy_loss(logp, torch.zeros(4, 1), adv, torch.ones(4, 1), **PPO)
    # per token -min(r A, clip(r) A): [-1.2 (clipped), 1.5, -0.5, 0.8 (clipped)], token mean over 4
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4)
    loss.backward()
    # d/dlogp (-r A) = -A r where unclipped, 0 where clipped; / 4 for the mean
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 1.5 / 4, -0.5 / 4, 0.0])
    assert stats["pg/clipfrac"] == 0.5
    assert stats["pg/ratio_mean"] == pytest.approx(1.0)
    assert stats["pg/ratio_min"] == pytest.approx(0.5)
    assert stats["pg/ratio_max"] == pytest.approx(1.5)


def test_clip_higher_and_full_gradient_inside_the_range():
    loss, _ = policy_loss(T([[LN(1.5)]]), T([[0.0]]), T([1.0]), T([[1.0]]), **{**PPO, "clip_eps_high": 0.28})
    assert loss.item() == pytest.approx(-1.28)
    logp = T([[LN(1.1)]], requires_grad=True)
    loss, stats = policy_loss(logp, T([[0.0]]), T([2.0]), T([[True]]), **PPO)
    loss.backward()
    assert loss.item() == pytest.approx(-2.2)
    assert logp.grad.item() == pytest.approx(-2.2)  # both branches equal: the full gradient, not half
    assert stats["pg/clipfrac"] == 0.0


def test_aggregations_by_hand_ignore_padding():
    nan = float("nan")
    values = T([[1.0, 2.0, 3.0], [4.0, nan, nan], [nan, nan, nan]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(values, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(values, mask, "seq_mean_token_sum").item() == pytest.approx((6 + 4) / 2)
    with pytest.raises(SmdInputError, match="loss_agg"):
        aggregate(values, mask, "sum")


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_empty_mask_gives_zero_not_nan(agg):
    x = torch.randn(2, 3, requires_grad=True)
    out = aggregate(x, torch.zeros(2, 3, dtype=torch.bool), agg)
    out.backward()
    assert out.item() == 0.0 and (x.grad == 0).all()


def test_policy_loss_aggregations_by_hand():
    # ratio 1 everywhere: per-token loss = -A; row 0 has 3 tokens (A = 1), row 1 has 1 token (A = -2)
    logp = torch.zeros(2, 3)
    mask = T([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = T([1.0, -2.0])
    got = {
        agg: policy_loss(logp, logp, adv, mask, **{**PPO, "loss_agg": agg})[0].item()
        for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
    }
    assert got["token_mean"] == pytest.approx((-3 + 2) / 4)
    assert got["seq_mean_token_mean"] == pytest.approx((-1 + 2) / 2)
    assert got["seq_mean_token_sum"] == pytest.approx((-3 + 2) / 2)


def test_token_weights_scale_the_loss_and_get_no_gradient():
    w = T([[2.0, 0.5]], requires_grad=True)
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), T([1.0]), torch.ones(1, 2), token_weights=w, **PPO)
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert logp.grad.tolist() == [[pytest.approx(-1.0), pytest.approx(-0.25)]]
    assert w.grad is None


def test_policy_loss_validates_shapes():
    with pytest.raises(SmdInputError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), **PPO)
    with pytest.raises(SmdInputError, match="mask"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 2), **PPO)


# ------------------------------------------------------------------------------------------- KL terms
def _logits(*probs):
    return torch.log(T(probs)).view(1, 1, -1)


def test_dense_teacher_kl_direction_is_kl_dense_to_masked():
    p, q = (0.5, 0.5), (0.9, 0.1)  # p = dense (teacher), q = masked (student)
    kl_pq = 0.5 * LN(0.5 / 0.9) + 0.5 * LN(0.5 / 0.1)  # 0.5108
    kl_qp = 0.9 * LN(0.9 / 0.5) + 0.1 * LN(0.1 / 0.5)  # 0.3681
    mask = torch.ones(1, 1)
    got = dense_teacher_kl(masked_logits=_logits(*q), dense_logits=_logits(*p), mask=mask, loss_agg="token_mean").item()
    swapped = dense_teacher_kl(masked_logits=_logits(*p), dense_logits=_logits(*q), mask=mask, loss_agg="token_mean").item()
    assert got == pytest.approx(kl_pq, rel=1e-6)
    assert swapped == pytest.approx(kl_qp, rel=1e-6)
    assert abs(got - swapped) > 0.1


def test_dense_teacher_kl_applies_temperature_to_both():
    # tau = 2: dense logits [0, 2 ln 3] -> p = [1/4, 3/4]; masked logits [4, 4] -> q = [1/2, 1/2]
    dense = T([0.0, 2 * LN(3)]).view(1, 1, 2)
    masked = T([4.0, 4.0]).view(1, 1, 2)
    expected = 0.25 * LN(0.25 / 0.5) + 0.75 * LN(0.75 / 0.5)
    got = dense_teacher_kl(masked, dense, torch.ones(1, 1), temperature=2.0, loss_agg="token_mean").item()
    assert got == pytest.approx(expected, rel=1e-6)


def test_dense_teacher_gets_no_gradient_and_student_gradient_is_q_minus_p():
    torch.manual_seed(0)
    masked = torch.randn(2, 3, 7, requires_grad=True)
    dense = torch.randn(2, 3, 7, requires_grad=True)  # the caller "forgot" no_grad
    mask = T([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    tau = 0.7
    dense_teacher_kl(masked, dense, mask, temperature=tau, loss_agg="token_mean").backward()
    assert dense.grad is None
    # d KL(p || softmax(z / tau)) / dz = (q - p) / tau, token mean over 5 valid tokens, 0 on padding
    q = torch.softmax(masked.detach() / tau, -1)
    p = torch.softmax(dense.detach() / tau, -1)
    expected = (q - p) / tau / 5 * mask.unsqueeze(-1)
    assert torch.allclose(masked.grad, expected, atol=1e-6)


def test_dense_teacher_kl_zero_probability_entries_are_finite():
    dense = T([0.0, -float("inf"), 1.0]).view(1, 1, 3)
    masked = torch.zeros(1, 1, 3, requires_grad=True)
    kl = dense_teacher_kl_per_token(masked, dense)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(masked.grad).all()
    p1 = 1 / (1 + math.e)
    expected = p1 * LN(p1 * 3) + (1 - p1) * LN((1 - p1) * 3)
    assert kl.item() == pytest.approx(expected, rel=1e-6)


def test_reference_kl_estimators_by_hand():
    logp, ref = T([[LN(0.5)]]), T([[LN(0.25)]])  # d = ref - logp = -ln 2
    d = -LN(2)
    mask = torch.ones(1, 1)
    assert reference_kl(logp, ref, mask, kind="k1", loss_agg="token_mean").item() == pytest.approx(-d)
    assert reference_kl(logp, ref, mask, kind="k2", loss_agg="token_mean").item() == pytest.approx(0.5 * d * d)
    assert reference_kl(logp, ref, mask, kind="k3", loss_agg="token_mean").item() == pytest.approx(math.exp(d) - d - 1)
    with pytest.raises(SmdInputError):
        reference_kl(logp, ref, mask, kind="k4", loss_agg="token_mean")


# ----------------------------------------------------------------------------- off-policy corrections
def test_tis_weights_truncation_token_and_sequence():
    learner = T([[LN(3.0), LN(0.5), LN(1.5)], [LN(0.5), LN(0.5), 9.0]], requires_grad=True)
    rollout = torch.zeros(2, 3)
    mask = T([[1, 1, 1], [1, 1, 0]])
    w = tis_weights(learner, rollout, mask, level="token", cap=2.0)
    assert not w.requires_grad
    assert w.tolist() == [
        [pytest.approx(2.0), pytest.approx(0.5), pytest.approx(1.5)],
        [pytest.approx(0.5), pytest.approx(0.5), 0.0],
    ]
    ws = tis_weights(learner, rollout, mask, level="sequence", cap=2.0)
    # row 0: 3 * 0.5 * 1.5 = 2.25 -> 2; row 1: 0.25 (the padded 9.0 does not count)
    assert ws.tolist() == [[pytest.approx(2.0)] * 3, [pytest.approx(0.25), pytest.approx(0.25), 0.0]]
    ws3 = tis_weights(learner, rollout, mask, level="sequence", cap=3.0)
    assert ws3[0, 0].item() == pytest.approx(2.25)
    # a huge sequence log-ratio does not overflow
    big = tis_weights(torch.full((1, 200), 5.0), torch.zeros(1, 200), torch.ones(1, 200), level="sequence", cap=2.0)
    assert (big == 2.0).all()


def _rejection_batch():
    """rollout = 0, so the learner log-probs are the log-ratios; the rows, by Sparse-RL's official rules
    (token window [0.5, 1.5], veto 1e-4, weight cap 1.5):"""
    ratios = [
        [1.2, 0.8, 1.0],  # all inside the window: kept, weights 1.2, 0.8, 1.0
        [2.0, 1.4, 1.0],  # (third token padding) 2.0 > 1.5 masked; 1.4 kept
        [5e-5, 1.0, 1.0],  # 5e-5 < 1e-4: the whole sequence vetoed
        [0.4, 1.1, 1.3],  # 0.4 < 0.5 masked; 1.1, 1.3 kept
        [1.0, 1.0, 1.0],  # no valid token
    ]
    mask = T([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    return torch.log(T(ratios, dtype=torch.float64)), torch.zeros(5, 3, dtype=torch.float64), mask


# kept weights 1.2, 0.8, 1.0, 1.4, 1.1, 1.3: 6 tokens, sum 6.8
KEPT_MEAN = 6.8 / 6


def test_sparse_rl_official_rules_by_hand():
    learner, rollout, mask = _rejection_batch()
    keep, w, stats = sparse_rl_rejection(learner, rollout, mask, **RULES)  # the defaults: the official configuration
    assert keep.tolist() == [
        [True, True, True],
        [False, True, False],
        [False, False, False],
        [False, True, True],
        [False, False, False],
    ]
    assert w.tolist() == [
        pytest.approx([1.2, 0.8, 1.0]),
        pytest.approx([0.0, 1.4, 0.0]),
        [0.0, 0.0, 0.0],
        pytest.approx([0.0, 1.1, 1.3]),
        [0.0, 0.0, 0.0],
    ]
    # 4 sequences with tokens, row 2 vetoed; 11 valid tokens, 6 kept
    assert stats == {"rejection/seq_fraction": 0.25, "rejection/token_fraction": pytest.approx(5 / 11)}
    counts, sums = sparse_rl_weight_sums(keep, w)
    assert counts.tolist() == [3, 1, 0, 2, 0]
    assert sums.tolist() == pytest.approx([3.0, 1.4, 0.0, 2.4, 0.0])


def test_sparse_rl_veto_window_cap_and_geometric_rule():
    learner, rollout, mask = _rejection_batch()
    # veto off: row 2's 5e-5 token is only masked by the window, its two 1.0 tokens stay
    keep, _, stats = sparse_rl_rejection(learner, rollout, mask, **{**RULES, "veto_threshold": 0.0})
    assert keep[2].tolist() == [False, True, True] and stats["rejection/seq_fraction"] == 0.0
    # veto just below 5e-5: not vetoed either
    keep, _, _ = sparse_rl_rejection(learner, rollout, mask, **{**RULES, "veto_threshold": 4e-5})
    assert keep[2].tolist() == [False, True, True]
    # a wider window with a lower cap: 2.0 and 0.4 kept, weights truncated at 1.25
    keep, w, stats = sparse_rl_rejection(learner, rollout, mask, **{**RULES, "token_ratio_low": 0.1, "token_ratio_high": 3.0,
                                                                 "cap": 1.25})
    assert keep[1].tolist() == [True, True, False] and keep[3].tolist() == [True, True, True]
    assert w[1].tolist() == pytest.approx([1.25, 1.25, 0.0]) and w[3].tolist() == pytest.approx([0.4, 1.1, 1.25])
    assert stats["rejection/token_fraction"] == pytest.approx(3 / 11)  # row 2's three tokens
    # the geometric-mean rule (off by default), c = 1.25: row 1's (2 * 1.4)^(1/2) = 1.67 > 1.25 rejected;
    # row 3's (0.4 * 1.1 * 1.3)^(1/3) = 0.830 >= 1 / 1.25 kept; row 0's 0.96^(1/3) kept
    keep, _, stats = sparse_rl_rejection(learner, rollout, mask, **{**RULES, "seq_ratio_max": 1.25})
    assert keep.any(dim=-1).tolist() == [True, False, False, True, False]
    assert stats["rejection/seq_fraction"] == 0.5
    with pytest.raises(SmdInputError, match="token window"):
        sparse_rl_rejection(learner, rollout, mask, **{**RULES, "token_ratio_low": 1.5})


# ---------------------------------------------------------------------------------------- composition
def _batch(seed=0, b=2, t=3, v=5):
    g = torch.Generator().manual_seed(seed)
    masked_logits = torch.randn(b, t, v, generator=g, requires_grad=True)
    dense_logits = torch.randn(b, t, v, generator=g, requires_grad=True)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = T([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rollout = token_logprobs(masked_logits.detach(), tokens) + 0.05 * torch.randn(b, t, generator=g)
    return masked_logits, dense_logits, tokens, mask, rollout


def test_smd_gradient_is_masked_grpo_gradient_plus_lambda_kl_gradient():
    masked_logits, dense_logits, tokens, mask, rollout = _batch()
    adv, lam, tau = T([1.0, -1.0]), 0.3, 0.8

    def grad_of(fn):
        masked_logits.grad = None
        fn().backward()
        return masked_logits.grad.clone()

    def smd():
        total, terms = full_logits_objective_loss(
            LearnerParams(objective="smd", kl_lambda=lam),
            ObjectiveBatch(advantages=adv, mask=mask, rollout_logp=rollout,
                           masked_logp=token_logprobs(masked_logits, tokens, tau)),
            masked_logits=masked_logits,
            dense_logits=dense_logits,
            temperature=tau,
        )
        assert terms["loss/total"] == pytest.approx(terms["loss/pg"] + lam * terms["loss/kl_dense"], rel=1e-6)
        return total

    g_smd = grad_of(smd)
    g_pg = grad_of(lambda: policy_loss(token_logprobs(masked_logits, tokens, tau), rollout, adv, mask, **PPO)[0])
    g_kl = grad_of(lambda: dense_teacher_kl(masked_logits, dense_logits, mask, temperature=tau, loss_agg="token_mean"))
    assert torch.allclose(g_smd, g_pg + lam * g_kl, atol=1e-6)
    assert g_kl.abs().sum() > 0 and g_pg.abs().sum() > 0
    assert dense_logits.grad is None


def test_shadow_ignores_lambda_and_needs_no_dense_pass():
    masked_logits, _, tokens, mask, rollout = _batch()
    adv = T([1.0, -1.0])
    logp = token_logprobs(masked_logits, tokens)
    batch = ObjectiveBatch(advantages=adv, mask=mask, rollout_logp=rollout, masked_logp=logp)
    total, terms = objective_loss(LearnerParams(objective="shadow", kl_lambda=0.5), batch)
    pg, _ = policy_loss(logp, rollout, adv, mask, **PPO)
    assert total.item() == pytest.approx(pg.item()) and terms["loss/kl_dense"] == 0.0
    # smd with lambda 0 is shadow, and needs no logits either
    total0, _ = objective_loss(LearnerParams(objective="smd", kl_lambda=0.0), batch)
    assert total0.item() == pytest.approx(pg.item())


def test_dual_clip_by_hand():
    # three one-token sequences, old = 0: ratios 5, 2, 5 with advantages -1, -1, +1; eps 0.2, c = 3
    logp = T([[LN(5.0)], [LN(2.0)], [LN(5.0)]], requires_grad=True)
    adv, mask, old = T([-1.0, -1.0, 1.0]), torch.ones(3, 1), torch.zeros(3, 1)
    loss, stats = policy_loss(logp, old, adv, mask, dual_clip_c=3.0, **PPO)
    # PPO: -min(r A, clip(r) A) = [5, 2, -1.2]; dual clip caps A < 0 at -c A = 3: [3, 2, -1.2]
    assert loss.item() == pytest.approx((3 + 2 - 1.2) / 3)
    assert stats["pg/dual_clipfrac"] == pytest.approx(1 / 3) and stats["pg/clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # capped token: no gradient; ratio 2 with A = -1: d(-r A)/dlogp = 2, / 3 tokens; clipped A > 0: none
    assert logp.grad.flatten().tolist() == [0.0, pytest.approx(2 / 3), 0.0]
    off, stats = policy_loss(logp, old, adv, mask, **PPO)
    assert off.item() == pytest.approx((5 + 2 - 1.2) / 3) and stats["pg/dual_clipfrac"] == 0.0
    with pytest.raises(SmdInputError, match="dual_clip_c"):
        policy_loss(logp, old, adv, mask, dual_clip_c=1.0, **PPO)


def test_naive_bypass_and_dense_take_the_rollout_as_old_with_dual_clip():
    _, dense_logits, tokens, mask, rollout = _batch()
    rollout = rollout - 2.0  # ratios e^2 > c = 3 against the rollout: the dual clip binds where A < 0
    adv = T([0.5, -1.0])
    dense_logp = token_logprobs(dense_logits, tokens)
    want = policy_loss(dense_logp, rollout, adv, mask, dual_clip_c=3.0, **PPO)[0].item()
    assert want != pytest.approx(policy_loss(dense_logp, rollout, adv, mask, **PPO)[0].item())
    for objective in ("naive_bypass", "dense"):
        total, terms = objective_loss(LearnerParams(objective=objective),
                                      ObjectiveBatch(advantages=adv, mask=mask, rollout_logp=rollout,
                                                     dense_logp=dense_logp))
        assert total.item() == pytest.approx(want) and terms["pg/dual_clipfrac"] > 0


def test_naive_recomputes_old_and_ignores_the_rollout():
    _, dense_logits, tokens, mask, rollout = _batch()
    adv = T([0.5, -1.0])
    dense_logp = token_logprobs(dense_logits, tokens)
    naive = LearnerParams(objective="naive")
    for shift in (0.0, 3.0):  # the rollout's log-probs play no part
        total, terms = objective_loss(naive, ObjectiveBatch(advantages=adv, mask=mask, rollout_logp=rollout - shift,
                                                            dense_logp=dense_logp))
        # old = the dense learner's own log-probs: ratio exactly 1, loss = -token mean of A = -(3 * 0.5 - 2) / 5
        assert terms["pg/ratio_min"] == terms["pg/ratio_max"] == 1.0 and terms["pg/clipfrac"] == 0.0
        assert total.item() == pytest.approx(0.1)
    # with an explicit old (the parity pass's), the ratio is against it
    old = dense_logp.detach() - 0.1
    _, terms = objective_loss(naive, ObjectiveBatch(advantages=adv, mask=mask, rollout_logp=rollout,
                                                    dense_logp=dense_logp, old_logp=old))
    assert terms["pg/ratio_mean"] == pytest.approx(math.exp(0.1))


def test_tis_objective_by_hand():
    dense_logp = T([[LN(3.0), LN(0.5)]], requires_grad=True)
    total, terms = objective_loss(
        LearnerParams(objective="tis", tis_cap=2.0),
        ObjectiveBatch(advantages=T([1.0]), mask=torch.ones(1, 2), rollout_logp=torch.zeros(1, 2), dense_logp=dense_logp),
    )
    # old = dense (ratio 1), weights [min(3, 2), 0.5]: loss = -(2 + 0.5) / 2
    assert total.item() == pytest.approx(-1.25)
    total.backward()
    assert dense_logp.grad.tolist() == [[pytest.approx(-1.0), pytest.approx(-0.25)]]
    assert terms["is_weight/mean"] == pytest.approx(1.25)


def test_sparse_rl_objective_batch_normalisation_and_aggregation():
    learner, rollout, mask = _rejection_batch()
    adv = torch.ones(5)

    def run(rows, loss_agg, sparse_rl_weight_mean=None, **kw):
        dense_logp = learner[rows].clone().requires_grad_(True)
        total, terms = objective_loss(
            LearnerParams(objective="sparse_rl", loss_agg=loss_agg, sparse_rl_loss_agg=None, **kw),
            ObjectiveBatch(advantages=adv[rows], mask=mask[rows], rollout_logp=rollout[rows], dense_logp=dense_logp,
                           sparse_rl_weight_mean=sparse_rl_weight_mean))
        total.backward()
        return total.item(), terms, dense_logp.grad

    # ratio 1 (old = dense), A = 1: per token -w_t / mean; the kept weights' mean is 6.8 / 6
    total, terms, grad = run(slice(None), "token_mean")
    assert total == pytest.approx(-1.0)  # normalised to mean 1 over the kept tokens
    assert terms["is_weight/mean"] == pytest.approx(1.0)
    assert terms["rejection/seq_fraction"] == 0.25 and terms["rejection/token_fraction"] == pytest.approx(5 / 11)
    assert grad[0].tolist() == pytest.approx([-1.2 / KEPT_MEAN / 6, -0.8 / KEPT_MEAN / 6, -1.0 / KEPT_MEAN / 6])
    assert grad[1, 0] == 0 and (grad[2] == 0).all() and grad[3, 0] == 0  # masked tokens, vetoed sequence
    # the official per-sequence token mean: rows 0, 1, 3 count, means 1.0, 1.4, 1.2 (/ the batch mean)
    total, _, _ = run(slice(None), "seq_mean_token_mean")
    assert total == pytest.approx(-(1.0 + 1.4 + 1.2) / 3 / KEPT_MEAN)
    # un-normalised: the raw truncated weights
    total, _, _ = run(slice(None), "token_mean", sparse_rl_batch_normalize=False)
    assert total == pytest.approx(-6.8 / 6)
    # a micro-batch normalises by the whole mini-batch's mean, given from outside (the learner's parity pass)
    part, _, _ = run(slice(0, 1), "token_mean", sparse_rl_weight_mean=KEPT_MEAN)
    assert part == pytest.approx(-1.0 / KEPT_MEAN)
    alone, _, _ = run(slice(0, 1), "token_mean")  # without it: the micro-batch's own mean (1.0)
    assert alone == pytest.approx(-1.0)


def test_sparse_rl_micro_batches_sum_to_the_mini_batch():
    """Micro-batches weighted by their share of kept tokens, each normalised by the mini-batch mean from
    `sparse_rl_weight_sums`, give the mini-batch's loss and gradient (what the learner's accumulation does)."""
    g = torch.Generator().manual_seed(3)
    learner = torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.4
    rollout = torch.zeros(6, 5, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=g) > 0.2
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    counts, sums = sparse_rl_weight_sums(*sparse_rl_rejection(learner, rollout, mask, **RULES)[:2])
    mean = float(sums.sum() / counts.sum())
    params = LearnerParams(objective="sparse_rl", sparse_rl_loss_agg=None)  # token_mean: shares of kept tokens

    def loss(rows, **kw):
        lp = learner[rows].clone().requires_grad_(True)
        total, _ = objective_loss(params, ObjectiveBatch(advantages=adv[rows], mask=mask[rows],
                                                         rollout_logp=rollout[rows], dense_logp=lp, **kw))
        total.backward()
        return total.item(), lp.grad

    whole, whole_grad = loss(slice(None))
    acc, grads = 0.0, []
    for rows in (slice(0, 2), slice(2, 6)):
        share = float(counts[rows].sum() / counts.sum())
        part, grad = loss(rows, sparse_rl_weight_mean=mean)
        acc += share * part
        grads.append(share * grad)
    assert acc == pytest.approx(whole)
    assert torch.allclose(torch.cat(grads), whole_grad)


def test_reference_kl_term_is_added():
    logp = T([[LN(0.5)]], requires_grad=True)
    kw = dict(advantages=T([0.0]), mask=torch.ones(1, 1), rollout_logp=T([[LN(0.5)]]), masked_logp=logp)
    params = LearnerParams(objective="shadow", ref_kl_coef=0.1)
    with pytest.raises(SmdInputError, match="ref_logp"):
        objective_loss(params, ObjectiveBatch(**kw))
    total, terms = objective_loss(params, ObjectiveBatch(ref_logp=T([[LN(0.25)]]), **kw))
    d = -LN(2)
    assert terms["loss/kl_ref"] == pytest.approx(math.exp(d) - d - 1)
    assert total.item() == pytest.approx(0.1 * (math.exp(d) - d - 1))


def test_objective_input_errors():
    kw = dict(
        advantages=T([1.0]),
        mask=torch.ones(1, 1),
        rollout_logp=torch.zeros(1, 1),
        masked_logp=torch.zeros(1, 1),
    )
    batch = ObjectiveBatch(**kw)
    # params built in code (model_copy) skip pydantic's validation: the objective still refuses these
    with pytest.raises(SmdInputError, match="unknown objective"):
        objective_loss(LearnerParams().model_copy(update={"objective": "ppo"}), batch)
    with pytest.raises(SmdInputError, match="kl_lambda"):
        objective_loss(LearnerParams().model_copy(update={"kl_lambda": -0.1}), batch)
    with pytest.raises(SmdInputError, match="masked_logits, dense_logits"):
        full_logits_objective_loss(LearnerParams(objective="smd", kl_lambda=0.1), batch)
    with pytest.raises(SmdInputError, match="kl_per_token"):  # the learner's path: the chunked teacher KL
        objective_loss(LearnerParams(objective="smd", kl_lambda=0.1), batch)
    with pytest.raises(SmdInputError, match="dense_logp"):
        objective_loss(LearnerParams(objective="tis"), batch)


# ------------------------------------------------------------------------------------------- registry
def test_every_objective_is_registered_with_a_spec():
    assert sorted(OBJECTIVE_REGISTRY) == sorted(OBJECTIVES)
    for name in OBJECTIVES:
        spec = objective_spec(name)
        assert spec.name == name and callable(spec.fn)
    with pytest.raises(SmdInputError, match="unknown objective 'ppo'"):
        objective_spec("ppo")


def test_the_spec_table():
    specs = {name: objective_spec(name) for name in OBJECTIVES}
    assert {n for n, s in specs.items() if s.masked_forward} == {"smd", "shadow"}
    assert {n for n, s in specs.items() if s.old_logp == "recomputed"} == {"naive", "tis", "sparse_rl", "smd_released"}
    assert {n for n, s in specs.items() if s.old_logp == "rollout"} == {"smd", "shadow", "naive_bypass", "dense"}
    assert {n for n, s in specs.items() if s.dense_teacher} == {"smd"}
    assert {n: s.row_weights for n, s in specs.items() if s.row_weights != "none"} == {"tis": "tis",
                                                                                      "sparse_rl": "sparse_rl"}
    assert {n for n, s in specs.items() if s.token_filter != "none"} == {"smd_released"}
    assert {n for n, s in specs.items() if s.needs_masks} == {"smd", "shadow", "smd_released"}


@pytest.mark.parametrize("name", OBJECTIVES)
def test_each_objective_does_what_its_spec_says(name):
    """The registered function reads the log-probs of its spec's forward, takes its spec's old policy (ratio
    against the rollout, or 1), weights tokens only with row weights, and adds the teacher KL only with
    dense_teacher (kl_lambda is ignored by the others)."""
    spec = objective_spec(name)
    logp, rollout = T([[LN(0.5), LN(0.25)]]), T([[LN(0.4), LN(0.25)]])  # ratios 1.25 and 1 against the rollout
    field, other = ("masked_logp", "dense_logp") if spec.masked_forward else ("dense_logp", "masked_logp")
    base = dict(advantages=T([1.0]), mask=torch.ones(1, 2, dtype=torch.bool), rollout_logp=rollout,
                trusted_mask=torch.ones(1, 2, dtype=torch.bool))  # read only by a token_filter objective
    params = LearnerParams(objective=name, kl_lambda=0.1)
    with pytest.raises(SmdInputError, match=field):
        objective_loss(params, ObjectiveBatch(**base, **{other: logp}))
    batch = ObjectiveBatch(**base, **{field: logp}, kl_per_token=torch.ones(1, 2))
    total, terms = objective_loss(params, batch)
    if spec.old_logp == "rollout":
        assert terms["pg/ratio_max"] == pytest.approx(1.25) and terms["pg/ratio_min"] == pytest.approx(1.0)
    else:
        assert terms["pg/ratio_min"] == terms["pg/ratio_max"] == 1.0
    assert ("is_weight/mean" in terms) == (spec.row_weights != "none")
    assert terms["loss/kl_dense"] == pytest.approx(1.0 if spec.masked_forward else 0.0)  # logged with a teacher
    added = 0.1 if spec.dense_teacher else 0.0
    assert total.item() == pytest.approx(terms["loss/pg"] + added) == pytest.approx(terms["loss/total"])
    if spec.dense_teacher:
        with pytest.raises(SmdInputError, match="kl_per_token"):
            objective_loss(params, ObjectiveBatch(**base, **{field: logp}))


def test_registering_a_name_twice_fails():
    def other(params, batch):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="'smd' is already registered"):
        register_objective("smd", masked_forward=True, old_logp="rollout")(other)
    with pytest.raises(ValueError, match="not a learner.objective choice"):
        register_objective("ppo", masked_forward=False, old_logp="rollout")(other)
    assert OBJECTIVE_REGISTRY["smd"].fn.__name__ == "smd_loss" and "ppo" not in OBJECTIVE_REGISTRY


def test_objective_groups_live_in_the_registry_only():
    """No module of the stages or the CLI lists objective names as a group (a tuple, list or set of two or
    more): what an objective runs is its spec's (`objective_spec`), defined once in objectives.py."""
    root = Path(__file__).resolve().parents[1]
    bad = []
    for path in sorted([*(root / "stages").rglob("*.py"), *(root / "cli").rglob("*.py")]):
        if path.name == "objectives.py" and path.parent.name == "learner":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and e.value in OBJECTIVES for e in node.elts):
                bad.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not bad, "objective names grouped outside the registry:\n" + "\n".join(bad)


# -------------------------------------------------------------------------------------------- params
def test_params_feed_objective_loss():
    params = LearnerParams(objective="tis", tis_level="sequence", clip_eps_high=0.28)
    total, _ = objective_loss(
        params,
        ObjectiveBatch(advantages=T([1.0]), mask=torch.ones(1, 2), rollout_logp=torch.zeros(1, 2),
                       dense_logp=torch.zeros(1, 2)),
    )
    assert total.item() == pytest.approx(-1.0)


@pytest.mark.parametrize(
    "override",
    [
        "learner.objective=ppo",
        "learner.kl_lambda=-1",
        "learner.loss_agg=sum",
        "learner.tis_level=batch",
        "learner.ref_kl_kind=k5",
        "learner.advantage_scale=rank",
        "learner.tis_cap=0.5",
        "learner.clip_eps_low=1.0",
        "learner.dual_clip_c=1.0",
        "learner.sparse_rl_token_ratio_high=0.9",
        "learner.sparse_rl_loss_agg=sum",
    ],
)
def test_bad_learner_params_fail_with_one_line(override, tmp_path):
    with pytest.raises(SmdInputError, match="learner"):
        load_params(None, [override])


def test_learner_params_defaults_and_unknown_key():
    p = LearnerParams()
    assert (p.objective, p.kl_lambda, p.loss_agg, p.clip_eps_low, p.clip_eps_high) == (
        "smd",
        0.1,
        "token_mean",
        0.2,
        0.2,
    )
    # Sparse-RL's official configuration (lsjia/Sparse-RL, slime `mis`), verl's dual-clip c = 3
    assert (p.sparse_rl_is_cap, p.sparse_rl_token_ratio_low, p.sparse_rl_token_ratio_high) == (1.5, 0.5, 1.5)
    assert (p.sparse_rl_veto_threshold, p.sparse_rl_batch_normalize, p.sparse_rl_seq_ratio_max) == (1e-4, True, None)
    assert p.dual_clip_c == 3.0
    assert loss_agg_for(p.model_copy(update={"objective": "sparse_rl"})) == "seq_mean_token_mean"
    assert loss_agg_for(p.model_copy(update={"objective": "naive"})) == "token_mean"
    with pytest.raises(ValidationError):
        LearnerParams(kl_lamda=0.2)


def test_token_entropy_by_hand():
    # p = softmax([ln 1, ln 1, ln 2]) = [1/4, 1/4, 1/2]: H = 2 * (1/4) ln 4 + (1/2) ln 2 = 1.5 ln 2
    logits = torch.log(torch.tensor([[[1.0, 1.0, 2.0], [1.0, 1.0, 1.0]]]))
    h = token_entropy(logits)
    assert h.shape == (1, 2)
    assert torch.allclose(h, torch.tensor([[1.5 * math.log(2), math.log(3)]]), atol=1e-6)
    # temperature 2 on logits [0, 2 ln 3]: softmax([0, ln 3]) = [1/4, 3/4]
    h2 = token_entropy(torch.tensor([[[0.0, 2 * math.log(3)]]]), temperature=2.0)
    want = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert abs(float(h2) - want) < 1e-6


def test_zero_advantage_group_fraction_by_hand():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.2])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 4])  # 7: equal, 3: differ, 9: equal, 4: singleton (no contrast)
    assert zero_advantage_group_fraction(rewards, groups) == 0.75
    assert zero_advantage_group_fraction(torch.zeros(0), torch.zeros(0, dtype=torch.long)) == 0.0
    # consistent with group_advantages: all-equal groups get exactly zero advantage
    adv = group_advantages(rewards, groups)
    assert (adv[[0, 1, 4, 5, 6]] == 0).all() and (adv[[2, 3]] != 0).all()


def test_unscored_rows_leave_the_group_baseline_as_trl_does():
    """TRL >= 1.6 (PR #5902): a row every reward function scored None is left out of its group's mean, std and
    count and gets advantage 0; checked against an independent numpy computation in float64."""
    rng = np.random.default_rng(5)
    rewards = rng.integers(0, 4, size=24).astype(np.float64)
    groups = np.repeat(np.arange(6), 4)
    scored = rng.random(24) > 0.3
    scored[20:24] = [True, False, False, False]  # a group with one scored row: no contrast
    scored[16:20] = False  # a group with none
    want = np.zeros(24)
    for g in range(6):
        rows = np.flatnonzero((groups == g) & scored)
        if len(rows) < 2 or np.ptp(rewards[rows]) == 0:
            continue
        mean, std = rewards[rows].mean(), rewards[rows].std(ddof=1)
        want[rows] = (rewards[rows] - mean) / (std + 1e-6)
    got = group_advantages(torch.from_numpy(rewards), torch.from_numpy(groups), scored=torch.from_numpy(scored))
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)
    assert (got.numpy()[~scored] == 0).all()
    # every row scored: the same as without the mask
    full = group_advantages(torch.from_numpy(rewards), torch.from_numpy(groups))
    assert torch.equal(group_advantages(torch.from_numpy(rewards), torch.from_numpy(groups),
                                        scored=torch.ones(24, dtype=torch.bool)), full)
