"""FlexAttention backend: block classification from evict_at, and agreement with the SDPA reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from schemas.raw_masks import visibility
from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
from stages.learner.flex_backend import (
    block_structure,
    build_block_mask,
    build_block_masks,
    flex_shadow_attention,
    pad_evict_at_to,
    padded_length,
)
from stages.learner.shadow_attention import pad_evict_at, response_logits
from tests.helpers import (
    attention_chain,
    flex_model_batch,
    model_chain,
    requires_cpu_flex,
    within_float32_bound,
)

TOL = 1e-5


def _evict_at(policy: str, lengths: list[int], prompt: int, L: int = 2, H: int = 2, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    ev = eviction_config(policy, 0.5, sinks=2, window=4)
    rows = [torch.from_numpy(synthetic_evict_at(policy, T, min(prompt, T - 1), L, H, ev, rng).astype(np.int64))
            for T in lengths]
    return pad_evict_at(rows, max(lengths))  # [L, B, H, T]


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "recent", "dense"])
def test_block_classification_is_exact(policy):
    """empty / full / partial from per-block min/max of evict_at equals the dense mask's blocks."""
    bs = 16
    ev = _evict_at(policy, [150, 97], prompt=40)[0]  # [B, H, T]
    Tp = padded_length(ev.shape[-1], bs)
    evp = pad_evict_at_to(ev, Tp)
    nonempty, full = block_structure(evp, bs)
    vis = visibility(evp).view(*evp.shape[:2], Tp // bs, bs, Tp // bs, bs)  # [B, H, i, q, j, k]
    assert torch.equal(nonempty, vis.any(dim=5).any(dim=3))
    assert torch.equal(full, vis.all(dim=5).all(dim=3))
    sm = build_block_mask(ev, num_q_heads=4, block_size=bs)  # GQA: 2 query heads per KV head
    assert sm.length == Tp and sm.prefix == int(evp.min()) // bs * bs  # rows before the first eviction: causal
    if policy == "dense":  # only right padding (key k >= 97 of row 1 is seen by itself only) "evicts"
        assert sm.prefix == 96
        whole = build_block_mask(_evict_at("dense", [160], prompt=40)[0], num_q_heads=4, block_size=bs)
        assert whole.prefix == 160 and whole.block_mask is None  # nothing evicted: no FlexAttention at all
        return
    assert 0 < sm.prefix < Tp  # prefill is dense, decode evicts
    first, n = sm.prefix // bs, Tp // bs
    bm = sm.block_mask
    assert bm.seq_lengths == (Tp - sm.prefix, Tp)
    dense_blocks = torch.zeros(2, 4, n - first, n, dtype=torch.bool)
    for b in range(2):
        for h in range(4):
            for i in range(n - first):
                n_p, n_f = int(bm.kv_num_blocks[b, h, i]), int(bm.full_kv_num_blocks[b, h, i])
                dense_blocks[b, h, i, bm.kv_indices[b, h, i, :n_p].long()] = True
                assert not dense_blocks[b, h, i, bm.full_kv_indices[b, h, i, :n_f].long()].any()  # disjoint
                dense_blocks[b, h, i, bm.full_kv_indices[b, h, i, :n_f].long()] = True
    assert torch.equal(dense_blocks, nonempty[:, :, first:].repeat_interleave(2, dim=1))
    assert (~nonempty[:, :, first:]).tril().any()  # some causal blocks are skipped


@requires_cpu_flex
def test_flex_attention_equals_sdpa_forward_and_backward():
    torch.manual_seed(0)
    ev = _evict_at("snapkv", [150, 97], prompt=40, L=1)
    B, H, G, T, D = 2, 2, 2, ev.shape[-1], 16
    q = torch.randn(B, H * G, T, D, requires_grad=True)
    k = torch.randn(B, H, T, D, requires_grad=True)
    v = torch.randn(B, H, T, D, requires_grad=True)
    go = torch.randn(B, H * G, T, D)
    for bs in (16, 32):
        masks = build_block_masks(ev, H * G, bs)
        out = flex_shadow_attention(q, k, v, ev[0], D**-0.5, masks, 0)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visibility(ev[0]).repeat_interleave(G, 1),
                                             scale=D**-0.5, enable_gqa=True)
        assert (out - ref).abs().max().item() <= TOL
        grads = torch.autograd.grad(out, (q, k, v), go)
        refs = torch.autograd.grad(ref, (q, k, v), go)
        for g, r in zip(grads, refs):  # gradients: float32 in another order, bounded by its reductions
            assert within_float32_bound(g, r, attention_chain(T, G * T, D))  # dk, dv: over the G query heads too
        with torch.no_grad():  # inference path (no custom backward)
            assert (flex_shadow_attention(q, k, v, ev[0], D**-0.5, masks, 0) - ref).abs().max().item() <= TOL


@requires_cpu_flex
def test_model_logits_and_gradients_flex_equal_sdpa(tmp_path):
    model, ids, evict_at, prompts, resp = flex_model_batch(tmp_path, "h2o", seed=3, ids_seed=0)
    results = {}
    for backend in ("sdpa", "flex"):
        model.zero_grad()
        extra = {"smd_block_masks": build_block_masks(evict_at, 4, 32)} if backend == "flex" else {}
        sel, targets, valid = response_logits(model, ids, evict_at, prompts, resp, backend, **extra)
        logp = torch.log_softmax(sel, -1).gather(-1, targets.unsqueeze(-1))[..., 0]
        logp[valid].sum().backward()
        results[backend] = (sel.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert (results["flex"][0] - results["sdpa"][0]).abs().max().item() <= TOL
    chain = model_chain(model.config, ids.shape[1])
    for name, g in results["sdpa"][1].items():
        assert within_float32_bound(results["flex"][1][name], g, chain), name


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("flex", marks=requires_cpu_flex), "tiled"])
def test_shared_prefix_teacher_pass_equals_separate_passes(tmp_path, backend):
    """Policy + teacher over a shared prefill (one prefix pass into a KV cache) == two full forwards."""
    from stages.learner.shadow_attention import response_logits_with_teacher, shared_prefix_length

    model, ids, evict_at, prompts, resp = flex_model_batch(tmp_path, "snapkv", seed=4, ids_seed=1)
    assert shared_prefix_length(evict_at, prompts, 16) == 32  # first eviction at 40 (prompt), block 16

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        return out

    model.zero_grad()
    with torch.no_grad():
        dense, _, _ = response_logits(model, ids, None, prompts, resp)
    extra = {"smd_block_masks": build_block_masks(evict_at, 4, 16)} if backend == "flex" else {}
    masked, targets, valid = response_logits(model, ids, evict_at, prompts, resp, backend, **extra)
    masked[valid].logsumexp(-1).sum().backward()
    ref = grads()
    m2, d2, t2, v2 = response_logits_with_teacher(model, ids, evict_at, prompts, resp, backend, 16)
    assert not d2.requires_grad and torch.equal(t2, targets) and torch.equal(v2, valid)
    assert (m2 - masked)[valid].abs().max().item() <= TOL
    assert (d2 - dense)[valid].abs().max().item() <= TOL
    m2[v2].logsumexp(-1).sum().backward()
    chain = model_chain(model.config, ids.shape[1])
    for name, g in grads().items():
        assert within_float32_bound(g, ref[name], chain), name
