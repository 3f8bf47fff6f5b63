"""`learner.objective: smd_released`, the rule of the SMD authors' released code
(huthvincent/RL-Post-Training-with-KV-Cache-Compression @ 26029e8, SMD/src/shadow_distillation_loss.py): the loss and
its gradient against an independent float64 transcription of that file (per-sample loops, slime's
sum_of_sample_mean), the trusted-token filter against the file's (T, T) boolean-mask arithmetic, hand-checked
visibilities, and the learner stage's terms against a float64 recomputation from the policy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from schemas.errors import SmdInputError
from schemas.params.learner import LearnerParams
from stages.common.model import load_policy
from stages.learner.data import build_micro_batch, load_learner_data, read_evict_at
from stages.learner.objectives import (
    TRUSTED_FRACTION,
    ObjectiveBatch,
    objective_loss,
    objective_spec,
    one_sided_distillation_per_token,
)
from stages.learner.released import released_trusted, released_visibility
from stages.learner.shadow_attention import response_logits
from stages.learner.train import run_learner
from tests.helpers import (
    float32_bound,
    make_iteration,
    make_model_dir,
    make_params,
    make_prompts,
    model_chain,
)


# ------------------------------------------------------------------ the released file, transcribed (float64)
def released_file_loss(lp: list[torch.Tensor], old: list[torch.Tensor], rollout: list[torch.Tensor],
                       adv: list[torch.Tensor], loss_masks: list[torch.Tensor], trusted: list[torch.Tensor],
                       eps: float, lam: float) -> torch.Tensor:
    """shadow_distillation_loss_function's arithmetic, sample by sample as the file runs it (lists of per-sample
    1-D tensors, as slime hands them), with slime's sum_of_sample_mean and the loss's x 1 / global batch size."""
    def sum_of_sample_mean(xs):
        return sum((x * m).sum() / torch.clamp_min(m.sum(), 1) for x, m in zip(xs, loss_masks))

    pg_losses = []
    for i in range(len(lp)):
        effective_mask = loss_masks[i].double() * trusted[i].double()
        ratio = torch.exp(lp[i] - old[i])
        pg_loss1 = -adv[i] * ratio
        pg_loss2 = -adv[i] * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)
        pg_losses.append(torch.max(pg_loss1, pg_loss2) * effective_mask)
    shadow_pg_loss = sum_of_sample_mean(pg_losses)
    kl = sum_of_sample_mean([(r - d).clamp(min=0) for r, d in zip(rollout, lp)])
    return (shadow_pg_loss + lam * kl) / len(lp)  # x num_microbatches / global_batch_size, one micro-batch


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 4, 1, 5]
    B, R = len(lengths), max(lengths)
    valid = torch.zeros(B, R, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, :n] = True
    dense = (-torch.rand(B, R, generator=g, dtype=torch.float64) * 3)
    old = dense + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64)  # ratios far enough from 1 to clip
    rollout = dense + 0.5 * torch.randn(B, R, generator=g, dtype=torch.float64)  # both signs of rollout - dense
    trusted = torch.rand(B, R, generator=g) < 0.5
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    # padding holds garbage that must never reach the result
    dense, old, rollout = (torch.where(valid, x, torch.full_like(x, 7.0)) for x in (dense, old, rollout))
    return lengths, valid, dense, old, rollout, trusted, adv


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lam", [0.1, 0.0])
def test_loss_and_gradient_equal_the_released_file(seed, lam):
    lengths, valid, dense, old, rollout, trusted, adv = _case(seed)
    params = LearnerParams(objective="smd_released", kl_lambda=lam)
    x = dense.clone().requires_grad_(True)
    total, terms = objective_loss(params, ObjectiveBatch(advantages=adv, mask=valid, rollout_logp=rollout,
                                                         dense_logp=x, old_logp=old, trusted_mask=trusted))
    (g,) = torch.autograd.grad(total, x)

    y = dense.clone().requires_grad_(True)
    per = lambda t, b: t[b, : lengths[b]]  # noqa: E731 - the per-sample view slime works on
    want = released_file_loss([per(y, b) for b in range(4)], [per(old, b) for b in range(4)],
                              [per(rollout, b) for b in range(4)], [adv[b] for b in range(4)],
                              [torch.ones(n, dtype=torch.float64) for n in lengths],
                              [per(trusted, b) for b in range(4)], eps=0.2, lam=lam)
    (g_want,) = torch.autograd.grad(want, y)
    assert total.dtype == torch.float64
    assert float(total.detach()) == pytest.approx(float(want.detach()), rel=1e-12, abs=1e-14)
    assert torch.allclose(g[valid], g_want[valid], rtol=1e-12, atol=1e-14)
    assert (g[~valid] == 0).all()
    assert terms["loss/total"] == pytest.approx(float(want.detach()), rel=1e-12, abs=1e-14)
    # the filter acts on the policy term only: an untrusted token gets only the distillation gradient,
    # -lam / (its sequence's tokens x sequences) where the rollout's log-prob is above the dense one, else 0
    untrusted = valid & ~trusted
    n = torch.tensor(lengths, dtype=torch.float64).unsqueeze(1).expand_as(dense)
    hand = torch.where(rollout > dense, -lam / (n * len(lengths)), torch.zeros_like(dense))
    assert int(untrusted.sum()) >= 3
    assert torch.allclose(g[untrusted], hand[untrusted], rtol=1e-12, atol=0)
    fraction = np.mean([float(trusted[b, :n].double().mean()) for b, n in enumerate(lengths)])
    assert terms[TRUSTED_FRACTION] == pytest.approx(fraction)


def test_distillation_term_by_hand():
    """clamp(rollout - dense, 0): 0.5 and 0 for rollout log-probs above and below; gradient -1 and 0 into dense; the
    rollout's log-probs are a fixed target."""
    rollout = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    dense = torch.tensor([[-1.5, -1.0]], requires_grad=True)
    d = one_sided_distillation_per_token(rollout, dense)
    assert d.tolist() == [[0.5, 0.0]]
    d.sum().backward()
    assert dense.grad.tolist() == [[-1.0, 0.0]] and rollout.grad is None


def test_spec_and_refusals():
    spec = objective_spec("smd_released")
    assert (spec.masked_forward, spec.old_logp, spec.dense_teacher, spec.token_filter, spec.needs_masks) == \
        (False, "recomputed", False, "visibility", True)
    assert LearnerParams().objective == "smd"  # the paper's rule stays the default
    base = dict(advantages=torch.ones(1), mask=torch.ones(1, 2, dtype=torch.bool), rollout_logp=torch.zeros(1, 2),
                dense_logp=torch.zeros(1, 2))
    with pytest.raises(SmdInputError, match="smd_released' needs trusted_mask"):
        objective_loss(LearnerParams(objective="smd_released"), ObjectiveBatch(**base))


# ----------------------------------------------------------------------------------- the trusted-token filter
def _file_visibility(sm: torch.Tensor, P: int, T: int) -> torch.Tensor:
    """The file's `resp_mask.float().sum(dim=-1) / total_len` on a (T, T) boolean mask."""
    return sm[P:T, :T].float().sum(dim=-1) / T


def _bool_mask(ev: np.ndarray) -> torch.Tensor:
    """(T, T) mask of one (layer, head) evict_at [T]: query q sees key k iff k <= q and evict_at[k] > q."""
    T = len(ev)
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    return torch.from_numpy((k <= q) & (ev[None, :] > q))


def test_visibility_of_the_released_interceptor_mask_by_hand():
    """The interceptor's mask (SMD/src/shadow_mask_interceptor.py): K retained prompt keys, every response key: the
    query of response token i sees K + i + 1 keys. Encoded as evict_at (dropped prompt keys gone from query P on)."""
    P, R, L, H = 20, 10, 2, 3
    T = P + R
    kept = [0, 1, 5, 6, 7, 12, 14, 17, 18, 19]  # K = 10 = int(0.5 * P)
    ev = np.full((T, L, H), T, dtype=np.int64)
    ev[[k for k in range(P) if k not in kept]] = P
    vis = released_visibility(ev, P)
    want = np.array([(10 + i + 1) / T for i in range(R)], dtype=np.float32)
    assert np.array_equal(vis, want)
    assert np.array_equal(vis, _file_visibility(_bool_mask(ev[:, 0, 0]), P, T).numpy())
    # (10 + i + 1) / 30 <= 0.55 for i <= 5: the first 6 tokens are trusted
    assert released_trusted(vis, 0.5, 0.05).tolist() == [True] * 6 + [False] * 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_visibility_equals_the_files_arithmetic(seed):
    """Random monotone masks: with one mask shared by every (layer, head) pair, bit-equal to the file's float32
    row sum / T; with pairs that differ, the mean over pairs of the rows' counts / T."""
    rng = np.random.default_rng(seed)
    P, R, L, H = 17, 9, 2, 2
    T = P + R
    pos = np.arange(T)
    one = np.where(rng.random(T) < 0.4, T, pos + 1 + (rng.random(T) * (T - pos)).astype(np.int64)).clip(max=T)
    shared = np.repeat(np.repeat(one[:, None, None], L, 1), H, 2)
    assert np.array_equal(released_visibility(shared, P), _file_visibility(_bool_mask(one), P, T).numpy())
    mixed = np.stack([np.where(rng.random(T) < 0.5, T, one) for _ in range(L * H)], -1).reshape(T, L, H)
    mixed = np.maximum(mixed, pos[:, None, None] + 1)
    counts = np.mean([_bool_mask(mixed[:, la, h])[P:T].sum(-1).numpy() for la in range(L) for h in range(H)], 0)
    assert np.allclose(released_visibility(mixed, P), counts / T, rtol=1e-6)


def test_filter_compares_in_float32_and_refuses_bad_input():
    # 0.55 in float32 is 0.550000011920929: a visibility of float32(0.55) is trusted, as in the file's torch code
    assert released_trusted(np.array([np.float32(0.55), np.float32(0.5500001)]), 0.5, 0.05).tolist() == [True, False]
    with pytest.raises(SmdInputError, match="need k < evict_at"):
        released_visibility(np.zeros((4, 1, 1), dtype=np.int64), 2)
    with pytest.raises(SmdInputError, match="retention"):
        released_trusted(np.zeros(2), 0.0, 0.05)


# ------------------------------------------------------------------------------------------ the learner stage
def test_learner_terms_equal_a_float64_recomputation(tmp_path):
    """One learn call of smd_released on a SnapKV rollout: loss/pg, loss/kl_dense and the trusted fraction equal the
    released formula computed in float64 from the starting policy's dense logits and the (T, T) masks."""
    model_dir = make_model_dir(tmp_path, "gqa")
    # prefill_only (the released code's mask: only prompt keys dropped): the late tokens see more than 55%
    params = make_params(**{"learner.objective": "smd_released", "rollout.eviction.compress": "prefill_only"})
    traj, masks = make_iteration(tmp_path, model_dir, make_prompts(tmp_path), params)
    out = run_learner(params, 1, model_dir, traj, masks, tmp_path / "policy")
    steps = json.loads(out["steps"].read_text())
    assert len(steps) == 1

    policy = load_policy(model_dir).double()
    cfg = policy.config
    data = load_learner_data(params.learner, traj, masks, cfg.num_hidden_layers, cfg.num_key_value_heads, True)
    rows = list(range(len(data)))
    mb = build_micro_batch(data, rows, masked=False)
    with torch.no_grad():
        logits, targets, valid = response_logits(policy, mb.input_ids, None, mb.prompt_lens, mb.resp_lens)
    logp = torch.log_softmax(logits / params.rollout.temperature, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    keep = params.rollout.eviction.keep_ratio
    per, trusted_fraction = [], []
    for b, r in enumerate(rows):
        P, n = mb.prompt_lens[b], mb.resp_lens[b]
        ev = read_evict_at(data, [r])[0].numpy()
        T = P + n
        counts = np.mean([_bool_mask(ev[:, la, h])[P:T].sum(-1).numpy() for la in range(ev.shape[1])
                          for h in range(ev.shape[2])], 0)
        trusted = torch.from_numpy(counts / T <= keep + 0.05)
        trusted_fraction.append(float(trusted.double().mean()))
        per.append((logp[b, :n], trusted, torch.from_numpy(data.rollout_logprobs[r]).double(),
                    float(data.advantages[r])))
    # old = the starting policy's own log-probs (ratio 1): the pg term is -A per trusted token
    pg = np.mean([float((-a * t.double()).sum()) / len(lp) for lp, t, _, a in per])
    kl = np.mean([float((ro - lp).clamp(min=0).sum()) / len(lp) for lp, _, ro, _ in per])
    bound = float32_bound(model_chain(cfg, max(data.length(r) for r in rows)), 1.0)
    assert steps[0]["loss/pg"] == pytest.approx(pg, abs=bound)
    assert steps[0]["loss/kl_dense"] == pytest.approx(kl, abs=bound)
    assert steps[0]["loss/total"] == pytest.approx(pg + 0.1 * kl, abs=2 * bound)
    assert steps[0][TRUSTED_FRACTION] == pytest.approx(np.mean(trusted_fraction))
    assert 0 < steps[0][TRUSTED_FRACTION] < 1  # the filter bites on this batch: the check has power
    assert kl > 10 * bound


def test_simulated_rollout_feeds_smd_released(tmp_path):
    """The code's own setting end to end: a rollout that samples densely and records SnapKV's prefill decisions
    (rollout.eviction.apply false), compacted, then one smd_released step whose filter bites; the masked objectives'
    parity gate refuses the same batch (its log-probs are the dense policy's, not the masked one's)."""
    model_dir = make_model_dir(tmp_path, "gqa")
    over = {"rollout.eviction.compress": "prefill_only", "rollout.eviction.apply": "false"}
    params = make_params(**{"learner.objective": "smd_released", **over})
    traj, masks = make_iteration(tmp_path, model_dir, make_prompts(tmp_path), params)
    steps = json.loads(run_learner(params, 1, model_dir, traj, masks, tmp_path / "policy")["steps"].read_text())
    assert 0 < steps[0][TRUSTED_FRACTION] < 1
    # dense sampling: the rollout's log-probs are the dense learner's, so the distillation term starts at ~0
    assert steps[0]["mismatch/logprob_abs_diff_max"] < 1e-4 and steps[0]["loss/kl_dense"] < 1e-5
    with pytest.raises(SmdInputError, match="parity gate"):
        run_learner(make_params(**{"learner.objective": "shadow", **over}), 1, model_dir, traj, masks,
                    tmp_path / "shadow")
