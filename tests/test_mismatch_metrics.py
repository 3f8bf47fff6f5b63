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
    "mismatch/is_ratio_mean",
    "mismatch/is_ratio_min",
    "mismatch/is_ratio_max",
    "mismatch/ess",
}


def test_identical_logp_is_neutral():
    logp = torch.log(torch.rand(3, 4) * 0.9 + 0.05)
    m = mismatch_metrics(logp, logp.clone(), torch.ones(3, 4))
    assert set(m) == NAMES and all(isinstance(v, float) for v in m.values())
    assert m["mismatch/kl"] == 0.0 and m["mismatch/k3_kl"] == 0.0
    assert m["mismatch/logprob_abs_diff_mean"] == 0.0 and m["mismatch/logprob_abs_diff_max"] == 0.0
    assert m["mismatch/is_ratio_mean"] == m["mismatch/is_ratio_min"] == m["mismatch/is_ratio_max"] == 1.0
    assert m["mismatch/ess"] == pytest.approx(1.0)


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
    assert m["mismatch/is_ratio_mean"] == pytest.approx(4 / 3)
    assert m["mismatch/is_ratio_min"] == pytest.approx(1.0)
    assert m["mismatch/is_ratio_max"] == pytest.approx(2.0)
    # sequence weights [2, 1]: (2 + 1)^2 / (2 * (4 + 1)) = 0.9
    assert m["mismatch/ess"] == pytest.approx(0.9)


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
    assert m["mismatch/ess"] == pytest.approx(0.5)
    m = mismatch_metrics(torch.full((2, 500), 2.0), torch.zeros(2, 500), torch.ones(2, 500))
    assert m["mismatch/ess"] == pytest.approx(1.0)


def test_no_valid_token_is_neutral_and_shapes_are_checked():
    m = mismatch_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert m["mismatch/kl"] == 0.0 and m["mismatch/ess"] == 1.0
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
