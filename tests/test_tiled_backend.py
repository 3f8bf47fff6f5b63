"""The tiled shadow attention (stages/learner/tiled_backend.py): values and gradients equal the SDPA reference
(an explicit [B, H, T, T] visibility mask) for every eviction policy's masks, right-padded batches, GQA and MHA,
full forwards and rows continuing a cached prefix, any tile size; and through the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from schemas.errors import SmdInputError
from schemas.raw_masks import visibility
from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
from stages.learner.shadow_attention import pad_evict_at, response_logits
from stages.learner.tiled_backend import tiled_shadow_attention
from tests.helpers import attention_chain, flex_model_batch, model_chain, within_float32_bound

TOL = 1e-5


def _evict_at(policy: str, lengths: list[int], prompts: list[int], H: int, seed: int) -> torch.Tensor:
    """[B, H, T] evict_at of one layer for right-padded rows of `lengths` (synthetic schedules of `policy`)."""
    rng = np.random.default_rng(seed)
    cfg = eviction_config(policy, 0.5, sinks=2, window=4)
    rows = [torch.from_numpy(synthetic_evict_at(policy, T, P, 1, H, cfg, rng).astype(np.int64))
            for T, P in zip(lengths, prompts)]
    return pad_evict_at(rows, max(lengths))[0]


def _reference(q, k, v, ev, scale):
    """SDPA with the explicit mask: query rows are the last Q positions."""
    T, Q = k.shape[2], q.shape[2]
    mask = visibility(ev)[:, :, T - Q:].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _out_and_grads(fn, q, k, v, grad):
    for x in (q, k, v):
        x.grad = None
    out = fn()
    out.backward(grad)
    return out.detach(), [x.grad.clone() for x in (q, k, v)]


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "recent", "random", "dense"])
@pytest.mark.parametrize(("heads", "suffix", "tile"), [((4, 2), 0, 7), ((4, 2), 23, 256), ((2, 2), 0, 1)])
def test_tiled_equals_sdpa_forward_and_backward(policy, heads, suffix, tile):
    Hq, H = heads
    lengths, prompts = [61, 40, 53], [30, 18, 25]
    ev = _evict_at(policy, lengths, prompts, H, seed=len(policy))
    B, T, D = len(lengths), max(lengths), 8
    Q = T - suffix  # suffix > 0: the query rows continue a cached prefix of `suffix` positions
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, Q, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=True) for _ in range(2))
    grad = torch.randn(B, Hq, Q, D, generator=g)
    ref, ref_grads = _out_and_grads(lambda: _reference(q, k, v, ev, D**-0.5), q, k, v, grad)
    out, grads = _out_and_grads(lambda: tiled_shadow_attention(q, k, v, ev, D**-0.5, tile), q, k, v, grad)
    assert float((out - ref).abs().max()) <= TOL  # the parity contract's figure (docs/design.md §3)
    for got, want in zip(grads, ref_grads):  # gradients: float32 in another order, bounded by its reductions
        assert within_float32_bound(got, want, attention_chain(T, (Hq // H) * Q, D))


def test_tiled_rows_before_the_first_eviction_run_causally():
    """A dense schedule (nothing evicted) never reaches the tiles: the whole forward is plain causal attention."""
    ev = _evict_at("dense", [20], [10], 2, seed=0)
    assert int(ev.min()) == 20  # never evicted: evict_at = T
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(tiled_shadow_attention(q, k, v, ev, 8**-0.5), causal)


def test_tiled_refuses_masks_of_another_batch():
    ev = _evict_at("snapkv", [20, 18], [10, 9], 2, seed=0)
    q, k, v = torch.zeros(1, 2, 20, 8), torch.zeros(1, 2, 20, 8), torch.zeros(1, 2, 20, 8)
    with pytest.raises(ValueError, match=r"evict_at \(2, 2, 20\) does not cover the batch 1 x 20 tokens"):
        tiled_shadow_attention(q, k, v, ev, 8**-0.5)


def test_tiled_refuses_a_non_cpu_device():
    q = torch.zeros(1, 2, 4, 8, device="meta")
    with pytest.raises(SmdInputError, match=r"learner.attention_backend: tiled runs PyTorch's CPU flash-attention "
                                            r"kernel; on meta use flex"):
        tiled_shadow_attention(q, q, q, torch.zeros(1, 2, 4, dtype=torch.int64), 8**-0.5)


def test_model_logits_and_gradients_tiled_equal_sdpa(tmp_path):
    model, ids, evict_at, prompts, resp = flex_model_batch(tmp_path, "h2o", seed=3, ids_seed=0)
    results = {}
    for backend in ("sdpa", "tiled"):
        model.zero_grad()
        sel, targets, valid = response_logits(model, ids, evict_at, prompts, resp, backend)
        logp = torch.log_softmax(sel, -1).gather(-1, targets.unsqueeze(-1))[..., 0]
        logp[valid].sum().backward()
        results[backend] = (sel.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert (results["tiled"][0] - results["sdpa"][0]).abs().max().item() <= TOL
    chain = model_chain(model.config, ids.shape[1])
    for name, g in results["sdpa"][1].items():
        assert within_float32_bound(results["tiled"][1][name], g, chain), name


def test_tiles_split_rows_evenly():
    """No one-row tail tile: as few tiles as `tile_rows` allows, of near-equal sizes, covering the rows once."""
    from stages.learner.tiled_backend import _tiles

    assert _tiles(0, 257, 256) == [(0, 128), (128, 257)]
    assert _tiles(5, 5, 256) == [] and _tiles(3, 4, 256) == [(3, 4)]
    for first, rows, tile in [(0, 1000, 256), (17, 530, 7), (0, 64, 1), (2, 9, 100)]:
        tiles = _tiles(first, rows, tile)
        assert tiles[0][0] == first and tiles[-1][1] == rows
        assert all(b0 == a1 for (_, b0), (a1, _) in zip(tiles, tiles[1:]))
        sizes = [b - a for a, b in tiles]
        assert max(sizes) <= tile and max(sizes) - min(sizes) <= 1 and len(tiles) == -(-(rows - first) // tile)


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "random"])
@pytest.mark.parametrize(("suffix", "tile"), [(0, 5), (0, 256), (29, 3), (29, 256)])
def test_tile_plan_masks_equal_the_visibility(policy, suffix, tile):
    """Each step's key list is the keys some row of its tile sees, and its mask (computed on the `partial` columns
    only) is exactly the visibility of those keys to the tile's rows; every visible (row, key) is in one step; a
    tile after a sequence's first eviction never gathers the keys evicted there."""
    from stages.learner.tiled_backend import _plan, _tile_mask

    lengths, prompts = [70, 52, 64], [30, 26, 33]  # different prompts: the first eviction differs per sequence
    ev = _evict_at(policy, lengths, prompts, 2, seed=5)
    T = ev.shape[-1]
    Q = T - suffix
    first = min(int(ev.min()), Q) if suffix == 0 else 0
    vis = visibility(ev)[:, :, suffix:]  # [B, H, Q, T]
    covered = torch.zeros_like(vis)
    for i, h, a, b, cols, partial in _plan(ev, suffix, first, Q, tile):
        assert b - a <= tile
        mask = _tile_mask(ev, i, h, suffix + a, suffix + b, cols, partial, torch.float64)[0, 0]
        want = vis[i, h, a:b][:, cols]
        assert torch.equal(mask == 0, want) and bool(torch.isinf(mask[~want]).all())
        assert bool(want.any(0).all())  # every gathered key is seen by some row of the tile
        assert int(vis[i, h, a:b].sum()) == int(want.sum())  # no key the tile's rows see is left out
        covered[i, h, a:b] |= vis[i, h, a:b]
        lead = int(ev[i, h][ev[i, h] > suffix].min()) - suffix
        if a >= lead:  # after the first eviction: the keys evicted at it are not gathered
            assert not bool((ev[i, h, cols] <= suffix + lead).any())
    assert torch.equal(covered[:, :, first:], vis[:, :, first:])


@pytest.mark.parametrize(("suffix", "tile"), [(0, 6), (0, 256), (27, 4), (27, 256)])
def test_tiled_float64_equals_sdpa(suffix, tile):
    """In float64 the tiled pass (even tiles, per-sequence first-eviction tiles, masks on the partly visible
    columns, the kernel's GQA) equals the explicit-mask reference, values and gradients, to 1e-12."""
    lengths, prompts = [66, 41, 58], [31, 20, 28]
    ev = _evict_at("snapkv", lengths, prompts, 2, seed=9)
    B, T, D = len(lengths), max(lengths), 8
    Q = T - suffix
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, 6, Q, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, 2, T, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad = torch.randn(B, 6, Q, D, generator=g, dtype=torch.float64)
    ref, ref_grads = _out_and_grads(lambda: _reference(q, k, v, ev, D**-0.5), q, k, v, grad)
    out, grads = _out_and_grads(lambda: tiled_shadow_attention(q, k, v, ev, D**-0.5, tile), q, k, v, grad)
    assert float((out - ref).abs().max()) <= 1e-12
    for got, want in zip(grads, ref_grads):
        assert float((got - want).abs().max()) <= 1e-12 * max(1.0, float(want.abs().max()))


def test_tiled_backward_twice_with_retained_graph():
    """The key lists the forward keeps serve every backward of a retained graph (`smdctl probe-kl` differentiates
    one forward several times)."""
    ev = _evict_at("snapkv", [40, 33], [20, 15], 2, seed=1)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 40, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = tiled_shadow_attention(q, k, v, ev, 8**-0.5, 16)
    first = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    second = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("tile", [5, 256])
@pytest.mark.parametrize("policy", ["snapkv", "random", "dense"])
def test_tiled_shared_prefix_equals_the_concatenation_float64(policy, tile):
    """Rows reading shared prefixes (`prefix`, `prefix_rows`: a GRPO group's one prompt cache) give, in float64,
    the values and gradients of the same call on each row's concatenated keys and values, the prefixes' gradients
    the sum of their rows' (autograd's, through the concatenation), to 1e-12."""
    S, n, D = 24, 30, 8
    rows = [0, 0, 1, 0]
    lengths = [S + n, S + n - 5, S + n, S + n - 3]
    ev = _evict_at(policy, lengths, [26, 26, 30, 26], 2, seed=3)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 6, n, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(4, 2, n, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    pk, pv = (torch.randn(2, 2, S, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad = torch.randn(4, 6, n, D, generator=g, dtype=torch.float64)
    index = torch.tensor(rows)

    def concatenated():
        full_k, full_v = torch.cat([pk[index], k], dim=2), torch.cat([pv[index], v], dim=2)
        return tiled_shadow_attention(q, full_k, full_v, ev, D**-0.5, tile)

    def shared():
        return tiled_shadow_attention(q, k, v, ev, D**-0.5, tile, prefix=(pk, pv), prefix_rows=rows)

    leaves = (q, k, v, pk, pv)
    results = []
    for fn in (concatenated, shared):
        for x in leaves:
            x.grad = None
        out = fn()
        out.backward(grad)
        results.append((out.detach(), [x.grad.clone() for x in leaves]))
    (ref, ref_grads), (out, grads) = results
    with torch.no_grad():
        ref_sdpa = _reference(q, torch.cat([pk[index], k], dim=2), torch.cat([pv[index], v], dim=2), ev, D**-0.5)
    assert float((ref - ref_sdpa).abs().max()) <= 1e-12  # the concatenation's tiled pass is the reference's
    assert float((out - ref).abs().max()) <= 1e-12
    for got, want in zip(grads, ref_grads):
        assert float((got - want).abs().max()) <= 1e-12 * max(1.0, float(want.abs().max()))
    assert float(pk.grad[1].abs().max()) > 0  # the second prefix is read (row 2) and gets its gradient


def test_tiled_shared_prefix_refuses_rows_without_a_prefix():
    q = torch.randn(2, 4, 5, 8)
    k = torch.randn(2, 2, 5, 8)
    prefix = (torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    ev = torch.full((2, 2, 8), 100)
    with pytest.raises(ValueError, match="prefix_rows"):
        tiled_shadow_attention(q, k, k, ev, 0.3, prefix=prefix, prefix_rows=[0, 1])


def test_shared_prefix_needs_the_tiled_backend():
    """A forward that hands the attention a shared prefix on another backend fails in one line, instead of
    attending without the prefix."""
    from types import SimpleNamespace

    from stages.learner.shadow_attention import replay_shadow_mask

    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    prefix = [(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))]
    kwargs = {"smd_evict_at": torch.full((1, 1, 2, 8), 9), "smd_backend": "sdpa", "smd_prefix": prefix}
    with pytest.raises(ValueError, match="smd_prefix: the sdpa backend"):
        replay_shadow_mask(SimpleNamespace(layer_idx=0), q, k, k, None, kwargs)
