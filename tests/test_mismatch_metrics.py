"""Mismatch metrics and the finiteness guard on hand examples."""

from __future__ import annotations

import math

import pytest
import torch

from schemas.errors import SmdInputError
from stages.learner.metrics import check_finite, mismatch_metrics

LN = math.log
T = torch.tensor
NAMES = {
    "mismatch/kl",
    "mismatch/k3_kl",
    "mismatch/logprob_abs_diff_mean",
    "mismatch/logprob_abs_diff_max",
    "mismatch/token_ratio_mean",
    "mismatch/token_ratio_min",
    "mismatch/token_ratio_max",
    "mismatch/seq_kish_ess",
    "mismatch/rollout_is_mean",
    "mismatch/rollout_is_min",
    "mismatch/rollout_is_max",
    "mismatch/rollout_is_eff_sample_size",
}


def test_identical_logp_is_neutral():
    logp = torch.log(torch.rand(3, 4) * 0.9 + 0.05)
    m = mismatch_metrics(logp, logp.clone(), torch.ones(3, 4))
    assert set(m) == NAMES and all(isinstance(v, float) for v in m.values())
    assert m["mismatch/kl"] == 0.0 and m["mismatch/k3_kl"] == 0.0
    assert m["mismatch/logprob_abs_diff_mean"] == 0.0 and m["mismatch/logprob_abs_diff_max"] == 0.0
    assert m["mismatch/token_ratio_mean"] == m["mismatch/token_ratio_min"] == m["mismatch/token_ratio_max"] == 1.0
    assert m["mismatch/rollout_is_mean"] == m["mismatch/rollout_is_min"] == m["mismatch/rollout_is_max"] == 1.0
    assert m["mismatch/seq_kish_ess"] == pytest.approx(1.0)
    assert m["mismatch/rollout_is_eff_sample_size"] == pytest.approx(1.0)


def test_hand_example_with_padding():
    nan = float("nan")
    learner = T([[LN(2.0), 0.0], [0.0, nan]])
    rollout = T([[0.0, 0.0], [0.0, 5.0]])
    mask = T([[1, 1], [1, 0]], dtype=torch.bool)
    m = mismatch_metrics(learner, rollout, mask)
    # d = [ln 2, 0, 0] over the 3 valid tokens
    assert m["mismatch/kl"] == pytest.approx(-LN(2) / 3)
    assert m["mismatch/k3_kl"] == pytest.approx((2 - 1 - LN(2)) / 3)
    assert m["mismatch/logprob_abs_diff_mean"] == pytest.approx(LN(2) / 3)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(LN(2))
    assert m["mismatch/token_ratio_mean"] == pytest.approx(4 / 3)
    assert m["mismatch/token_ratio_min"] == pytest.approx(1.0)
    assert m["mismatch/token_ratio_max"] == pytest.approx(2.0)
    # sequence weights [2, 1]: (2 + 1)^2 / (2 * (4 + 1)) = 0.9
    assert m["mismatch/seq_kish_ess"] == pytest.approx(0.9)
    # verl's ESS (cap 2): token weights [2, 1, 1], mean 4/3, normalised [1.5, 0.75, 0.75], mean square 1.125
    assert m["mismatch/rollout_is_eff_sample_size"] == pytest.approx(8 / 9)
    assert m["mismatch/rollout_is_mean"] == pytest.approx(4 / 3)


def test_truncated_weights_under_verl_names():
    # token ratios 3, 1/3, 1 with cap C = 2: rollout_is_* truncate above at C (verl's truncate mode), the ESS
    # clamps to [1/C, C]: [2, 1/2, 1], mean 7/6, 1 / mean((w / mean)^2) = (7/6)^2 / ((4 + 1/4 + 1) / 3)
    m = mismatch_metrics(T([[LN(3.0), -LN(3.0), 0.0]]), torch.zeros(1, 3), torch.ones(1, 3), cap=2.0)
    assert m["mismatch/token_ratio_max"] == pytest.approx(3.0) and m["mismatch/rollout_is_max"] == pytest.approx(2.0)
    assert m["mismatch/rollout_is_min"] == pytest.approx(1 / 3)
    assert m["mismatch/rollout_is_mean"] == pytest.approx((2 + 1 / 3 + 1) / 3)
    assert m["mismatch/rollout_is_eff_sample_size"] == pytest.approx((7 / 6) ** 2 / (5.25 / 3))
    with pytest.raises(SmdInputError, match="cap"):
        mismatch_metrics(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cap=0.5)


def _verl_ess(learner, rollout, mask, cap):
    """verl's rollout_is_eff_sample_size, written independently (numpy, flat over the valid tokens): token
    weights w = exp(log pi_old - log pi_rollout) clamped to [1/cap, cap], w_norm = w / mean(w),
    ESS = 1 / mean(w_norm^2)."""
    import numpy as np

    lr = (learner.numpy().astype(np.float64) - rollout.numpy().astype(np.float64))[mask.numpy().astype(bool)]
    w = np.clip(np.exp(lr), 1.0 / cap, cap)
    w_norm = w / w.mean()
    return 1.0 / np.mean(w_norm**2)


@pytest.mark.parametrize("seed,cap", [(0, 2.0), (1, 1.5), (2, 5.0)])
def test_ess_matches_an_independent_implementation_of_verls_rule(seed, cap):
    g = torch.Generator().manual_seed(seed)
    learner = torch.randn(8, 12, generator=g) * 0.7 - 1.0
    rollout = torch.randn(8, 12, generator=g) * 0.7 - 1.0
    mask = torch.rand(8, 12, generator=g) > 0.3
    m = mismatch_metrics(learner, rollout, mask, cap=cap)
    assert m["mismatch/rollout_is_eff_sample_size"] == pytest.approx(_verl_ess(learner, rollout, mask, cap), rel=1e-9)
    assert 0 < m["mismatch/rollout_is_eff_sample_size"] <= 1


def test_kl_direction_is_rollout_to_learner():
    # one-token responses; rollout p = [0.5, 0.5], learner q = [0.9, 0.1]; one sample of each token, i.e.
    # samples in exact proportion to the rollout policy: the k1 mean is then exactly KL(p || q), not KL(q || p)
    rollout = T([[LN(0.5)], [LN(0.5)]])
    learner = T([[LN(0.9)], [LN(0.1)]])
    m = mismatch_metrics(learner, rollout, torch.ones(2, 1))
    kl_pq = 0.5 * LN(0.5 / 0.9) + 0.5 * LN(0.5 / 0.1)
    kl_qp = 0.9 * LN(0.9 / 0.5) + 0.1 * LN(0.1 / 0.5)
    assert m["mismatch/kl"] == pytest.approx(kl_pq)
    assert abs(m["mismatch/kl"] - kl_qp) > 0.1


def test_ess_does_not_overflow_on_long_sequences():
    learner = torch.zeros(2, 500)
    learner[0] = 2.0  # sequence log-weight 1000 against 0
    m = mismatch_metrics(learner, torch.zeros(2, 500), torch.ones(2, 500))
    assert m["mismatch/seq_kish_ess"] == pytest.approx(0.5)
    m = mismatch_metrics(torch.full((2, 500), 2.0), torch.zeros(2, 500), torch.ones(2, 500))
    assert m["mismatch/seq_kish_ess"] == pytest.approx(1.0)


def test_no_valid_token_is_neutral_and_shapes_are_checked():
    m = mismatch_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert set(m) == NAMES and m["mismatch/kl"] == 0.0 and m["mismatch/seq_kish_ess"] == 1.0
    assert m["mismatch/rollout_is_eff_sample_size"] == 1.0
    with pytest.raises(SmdInputError, match="shapes differ"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_check_finite():
    check_finite("rollout_logp", torch.zeros(2, 2))
    x = T([[0.0, float("nan")], [float("inf"), 1.0]])
    with pytest.raises(SmdInputError, match=r"rollout_logp: 2 non-finite value\(s\).*\(0, 1\)"):
        check_finite("rollout_logp", x)
    check_finite("rollout_logp", x, mask=T([[1, 0], [0, 1]]))  # padding is not checked
    with pytest.raises(SmdInputError, match=r"\(1, 0\)"):
        check_finite("rollout_logp", x, mask=T([[True, False], [True, True]]))
