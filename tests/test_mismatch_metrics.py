"""Mismatch metrics and the finiteness guard on hand examples."""

from __future__ import annotations

import math

import pytest
import torch

from schemas.errors import SmdInputError
from stages.learner.mismatch import check_finite, mismatch_metrics

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
    # token ratios 3, 1/3, 1 with cap C = 2: rollout_is_* truncate above at C (verl's truncate mode). The ESS:
    # verl 0.9.1 (the default) clamps the truncated weights to [0, C]: [2, 1/3, 1], mean 10/9,
    # 1 / mean((w / mean)^2) = (10/9)^2 / ((4 + 1/9 + 1) / 3); verl <= 0.8 clamped to [1/C, C]: [2, 1/2, 1]
    m = mismatch_metrics(T([[LN(3.0), -LN(3.0), 0.0]]), torch.zeros(1, 3), torch.ones(1, 3), cap=2.0)
    assert m["mismatch/token_ratio_max"] == pytest.approx(3.0) and m["mismatch/rollout_is_max"] == pytest.approx(2.0)
    assert m["mismatch/rollout_is_min"] == pytest.approx(1 / 3)
    assert m["mismatch/rollout_is_mean"] == pytest.approx((2 + 1 / 3 + 1) / 3)
    assert m["mismatch/rollout_is_eff_sample_size"] == pytest.approx((10 / 9) ** 2 / ((4 + 1 / 9 + 1) / 3))
    old = mismatch_metrics(T([[LN(3.0), -LN(3.0), 0.0]]), torch.zeros(1, 3), torch.ones(1, 3), cap=2.0,
                           verl_rule="0.8")
    assert old["mismatch/rollout_is_eff_sample_size"] == pytest.approx((7 / 6) ** 2 / (5.25 / 3))
    assert {k: v for k, v in old.items() if k != "mismatch/rollout_is_eff_sample_size"} == {
        k: v for k, v in m.items() if k != "mismatch/rollout_is_eff_sample_size"}  # only the ESS rule changed
    with pytest.raises(SmdInputError, match="cap"):
        mismatch_metrics(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cap=0.5)
    with pytest.raises(SmdInputError, match="verl_rule"):
        mismatch_metrics(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), verl_rule="0.7")


def _verl_is_metrics(learner, rollout, mask, cap, version="0.9.1"):
    """verl's token-level TIS metrics (`compute_rollout_correction_weights` -> `compute_is_metrics` in
    verl/trainer/ppo/rollout_corr_helper.py), written independently in numpy over the valid tokens, float64:
    w = min(exp(clip(log pi_old - log pi_rollout, -20, 20)), cap); rollout_is_mean/min/max of w;
    ESS = 1 / mean((w_e / (mean(w_e) + 1e-8))^2) with w_e = clip(w, 0, cap) in verl 0.9.1 and
    clip(w, 1/cap, cap) in verl 0.8."""
    import numpy as np

    lr = (learner.numpy().astype(np.float64) - rollout.numpy().astype(np.float64))[mask.numpy().astype(bool)]
    w = np.minimum(np.exp(np.clip(lr, -20.0, 20.0)), cap)
    w_e = np.clip(w, 0.0 if version == "0.9.1" else 1.0 / cap, cap)
    ess = 1.0 / np.mean((w_e / (w_e.mean() + 1e-8)) ** 2)
    return {"rollout_is_mean": w.mean(), "rollout_is_min": w.min(), "rollout_is_max": w.max(),
            "rollout_is_eff_sample_size": ess}


@pytest.mark.parametrize("version", ["0.9.1", "0.8"])
@pytest.mark.parametrize("seed,cap", [(0, 2.0), (1, 1.5), (2, 5.0)])
def test_is_metrics_match_an_independent_implementation_of_verls_rule(seed, cap, version):
    g = torch.Generator().manual_seed(seed)
    learner = torch.randn(8, 12, generator=g) * 0.7 - 1.0
    rollout = torch.randn(8, 12, generator=g) * 0.7 - 1.0
    mask = torch.rand(8, 12, generator=g) > 0.3
    m = mismatch_metrics(learner, rollout, mask, cap=cap, verl_rule=version)
    want = _verl_is_metrics(learner, rollout, mask, cap, version)
    for name, value in want.items():
        # smd divides by mean(w) exactly, verl by mean(w) + 1e-8: 1e-8 / mean(w) relative, mean(w) ~ 0.5 here
        assert m[f"mismatch/{name}"] == pytest.approx(value, rel=1e-7), name
    assert 0 < m["mismatch/rollout_is_eff_sample_size"] <= 1
    # ratios below 1/cap occur here, so the two versions' ESS differ (the test can tell them apart)
    other = _verl_is_metrics(learner, rollout, mask, cap, "0.8" if version == "0.9.1" else "0.9.1")
    assert abs(m["mismatch/rollout_is_eff_sample_size"] - other["rollout_is_eff_sample_size"]) > 1e-4


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
