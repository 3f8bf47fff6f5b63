"""The GPU path's CPU-checkable parts (issue 32): the shadow-mask counts through np.bincount equal np.add.at's, the
fused-kernel SDPA layouts of the rollout engine equal its current (enable_gqa) path, ZeRO's buckets fitted to the
model on CUDA, and a non-finite loss or gradient stops the learner naming the iteration and micro-batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas.params.rollout import EvictionParams
from schemas.raw_masks import visible_counts
from stages.common.kvcache import sampler
from stages.common.model import load_policy
from tests.helpers import make_model_dir, random_prompts


def _visible_counts_add_at(evict_at: np.ndarray) -> np.ndarray:
    """visible_counts as it was (np.add.at), the reference of the bincount version."""
    T = evict_at.shape[0]
    ends = np.clip(evict_at, 0, T).reshape(T, -1)
    hist = np.zeros((T + 1, ends.shape[1]), dtype=np.int64)
    np.add.at(hist, (ends, np.arange(ends.shape[1])[None, :].repeat(T, 0)), 1)
    return (np.arange(1, T + 1)[:, None] - np.cumsum(hist, axis=0)[:T]).reshape(evict_at.shape)


@pytest.mark.parametrize("T", [1, 2, 37])
def test_visible_counts_bincount_equals_add_at_and_a_direct_count(T):
    rng = np.random.default_rng(T)
    # evict_at [T, L, H]: a query q > k evicts key k, T = never, and out-of-range values clip as before
    ev = np.where(rng.random((T, 3, 2)) < 0.3, T, rng.integers(-2, T + 3, (T, 3, 2))).astype(np.int32)
    got = visible_counts(ev)
    assert got.dtype == np.int64 and got.shape == ev.shape
    np.testing.assert_array_equal(got, _visible_counts_add_at(ev))
    # a well-formed mask (key k evicted by a later query, or never): the visible keys counted directly
    ev = (np.arange(T)[:, None, None] + 1 + rng.integers(0, T + 1, (T, 3, 2))).clip(max=T).astype(np.int32)
    direct = np.array([[[sum(1 for k in range(q + 1) if ev[k, layer, h] > q) for h in range(2)]
                        for layer in range(3)] for q in range(T)])
    np.testing.assert_array_equal(visible_counts(ev), direct)


def _qkv(B, Hq, H, Q, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Q, D, generator=g, dtype=dtype), torch.randn(B, H, S, D, generator=g, dtype=dtype),
            torch.randn(B, H, S, D, generator=g, dtype=dtype))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_decode_layouts_equal_the_gqa_path(groups):
    q, k, v = _qkv(3, 2 * groups, 2, 1, 11, 8, torch.float64)
    valid = torch.rand(3, 2, 1, 11, generator=torch.Generator().manual_seed(1)) < 0.6
    valid[..., 4] = True  # every row sees at least one slot (the new key)
    ref = sampler.sdpa_gqa(q, k, v, 0.3, mask=valid, layout="gqa")
    # the reference of the reference: per query head its KV head's keys under its KV head's mask
    per_head = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[:, i:i + 1], k[:, i // groups:i // groups + 1], v[:, i // groups:i // groups + 1],
        attn_mask=valid[:, i // groups:i // groups + 1], scale=0.3) for i in range(2 * groups)], dim=1)
    torch.testing.assert_close(ref, per_head, rtol=0, atol=1e-12)
    if groups > 1:
        torch.testing.assert_close(sampler.sdpa_gqa(q, k, v, 0.3, mask=valid, layout="grouped"), ref, rtol=0,
                                   atol=1e-12)
    torch.testing.assert_close(sampler.sdpa_gqa(q, k, v, 0.3, mask=valid, layout="expand"), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("padded", [False, True])
def test_prefill_layouts_equal_the_gqa_path(padded):
    q, k, v = _qkv(2, 4, 2, 9, 9, 8, torch.float64, seed=2)
    if padded:
        pad = torch.tensor([0, 3])
        i = torch.arange(9)
        mask = (i[None, :] <= i[:, None])[None] & (i[None, None, :] >= pad[:, None, None])
        mask = (mask | torch.eye(9, dtype=torch.bool)[None])[:, None]  # [B, 1, P, P] as prefill_mask builds it
        kw = {"mask": mask}
    else:
        kw = {"causal": True}
    ref = sampler.sdpa_gqa(q, k, v, 0.25, layout="gqa", **kw)
    torch.testing.assert_close(sampler.sdpa_gqa(q, k, v, 0.25, layout="expand", **kw), ref, rtol=0, atol=1e-12)


def test_sdpa_layout_choice():
    q, k, _ = _qkv(1, 4, 2, 1, 5, 8, torch.float32)
    # decoding with GQA and a mask: grouped on every device (K/V read once per KV head)
    assert sampler.sdpa_layout(q, k, masked=True) == "grouped"
    assert sampler.sdpa_layout(q, k, masked=True, fused=True) == "grouped"
    assert sampler.sdpa_layout(q, k, masked=False) == "gqa"  # no mask (never in decoding): SDPA's own GQA
    q9 = torch.zeros(1, 4, 9, 8)
    assert sampler.sdpa_layout(q9, k, masked=True, fused=True) == "expand"
    assert sampler.sdpa_layout(q9, k, masked=False, fused=True) == "expand"  # float32 is_causal: flash takes none
    assert sampler.sdpa_layout(q9.bfloat16(), k, masked=False, fused=True) == "gqa"  # flash takes bf16 GQA causal
    assert sampler.sdpa_layout(q9, k[:, :1].expand(1, 4, 5, 8), masked=True, fused=True) == "gqa"  # no GQA


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    return load_policy(make_model_dir(tmp_path_factory.mktemp("gpu_path"), "gqa"))


@pytest.mark.parametrize("policy,lengths", [("dense", (13, 7, 10)), ("dense", (9, 9)), ("snapkv", (13, 7, 10)),
                                            ("h2o", (13, 7, 10))])
def test_engine_with_the_fused_layouts_gives_the_current_trajectories(gqa_model, monkeypatch, policy, lengths):
    """The whole engine with CUDA's layouts forced on the CPU (padded batch: prefill with the mask, decoding over
    the slot cache's validity) against the current path: same tokens and shadow masks, log-probs within float32
    rounding. Dense decodes through SDPA (the grouped layout), the others through the explicit pass."""
    prompts = random_prompts(lengths, seed=3)
    ev = EvictionParams(policy=policy, keep_ratio=0.5, sinks=2, window=4)

    def run():
        return sampler.generate_batch(gqa_model, prompts, ev, 6, eos_token_id=None,
                                      generator=torch.Generator().manual_seed(4))[0]

    ref = run()
    layout = sampler.sdpa_layout
    monkeypatch.setattr(sampler, "sdpa_layout", lambda q, k, masked, fused=None: layout(q, k, masked, True))
    got = run()
    for a, b in zip(ref, got):
        assert a.response_ids == b.response_ids
        np.testing.assert_array_equal(a.evict_at, b.evict_at)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_zero_buckets_fit_the_model_on_cuda_only():
    from schemas.params.learner import LearnerParams
    from stages.learner.deepspeed_runtime import DS_BUCKET_DEFAULT, bucket_size, ds_config

    cfg = LearnerParams()
    zero = ds_config(cfg, 1, 1, torch.bfloat16, cuda=True, hidden_size=2048)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 2048 * 2048
    assert bucket_size(40_000) == DS_BUCKET_DEFAULT == 500_000_000  # never above DeepSpeed's default
    cpu = ds_config(cfg, 1, 1, torch.float32, cuda=False, hidden_size=2048)["zero_optimization"]
    assert cpu == {"stage": 0}  # the CPU keeps DeepSpeed's defaults (zero_stage auto: 0 on one process)


@pytest.fixture(scope="module")
def learn_setup(tmp_path_factory):
    from tests.helpers import make_iteration, make_params, make_prompts

    root = tmp_path_factory.mktemp("nonfinite")
    model_dir = make_model_dir(root, "gqa")
    traj, masks = make_iteration(root, model_dir, make_prompts(root), make_params())
    return model_dir, traj, masks


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_non_finite_loss_or_gradient_stops_the_learner_and_writes_nothing(tmp_path, monkeypatch, learn_setup,
                                                                           where):
    """Injected into the second micro-batch: a NaN loss, or a finite loss whose gradient is infinite (d sqrt(u)/du
    at u = 0), as a bf16 overflow would give."""
    from stages.learner import train
    from tests.helpers import make_params

    model_dir, traj, masks = learn_setup
    real = train.objective_loss
    calls = []

    def injected(cfg, batch):
        loss, terms = real(cfg, batch)
        calls.append(1)
        if len(calls) == 2:
            if where == "loss":
                return loss * float("nan"), {**terms, "loss/total": float("nan")}
            logp = batch.masked_logp if batch.masked_logp is not None else batch.dense_logp
            return loss + torch.sqrt((logp - logp.detach()).sum()), terms
        return loss, terms

    monkeypatch.setattr(train, "objective_loss", injected)
    out = tmp_path / "iter-001" / "policy"
    with pytest.raises(train.NonFiniteError) as info:
        train.run_learner(make_params(**{"learner.micro_batch_size": 1}), 1, model_dir, traj, masks, out)
    message = str(info.value)
    assert "\n" not in message and message.startswith("learn iteration 1: non-finite ")
    if where == "loss":
        assert "non-finite loss at step 1, micro-batch 2 of " in message and "(nan)" in message
    else:
        assert "non-finite gradient norm at step 1 (micro-batches 1-" in message
    assert info.value.exit_code == 1
    assert not out.exists() and not (tmp_path / "iter-001" / "learn").exists()  # nothing written
