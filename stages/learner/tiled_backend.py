"""Tiled backend of the shadow attention (`learner.attention_backend: tiled`; docs/design.md §4).

The shadow mask replayed tile by tile through PyTorch's own fused CPU flash-attention kernel
(`aten._scaled_dot_product_flash_attention_for_cpu` and its backward, the kernel behind
`F.scaled_dot_product_attention` on CPU), forward and backward. For each tile of `tile_rows` query rows and
each (sequence, KV head), only the keys that head still shows to some row of the tile are gathered — key k
with k < tile end and evict_at[k] > tile start — so evicted keys cost nothing, and the mask of the tile
(`k <= q and evict_at[k] > q`, additive 0 / -inf) covers [rows x gathered keys] only: temporaries are
O(tile_rows x T) per step, never T x T. The query heads of a KV group share its mask and keys, so they run as
one call with the group's heads stacked as rows (GQA without repeating keys).

Rows before the first eviction see exactly their causal prefix: they run through the dense causal kernel
(`is_causal=True`), the dense learner's own.

Why: on CPU, PyTorch has no FlexAttention backward, and its compiled FlexAttention forward measured slower than
the flash kernel on the same rows (`smdctl bench learner`); the flash kernel has a fused backward that takes
the forward's log-sum-exp, so nothing but the output and log-sum-exp is kept between the passes. On CUDA use
`flex` (FlexAttention's compiled forward and backward).

Values and gradients equal the `sdpa` reference backend's to float rounding (tests/test_tiled_backend.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from schemas.errors import SmdInputError

DEFAULT_TILE_ROWS = 256


def _tile_steps(key: Tensor, value: Tensor, ev: Tensor, offset: int, first: int, tile_rows: int, groups: int,
                dtype: torch.dtype) -> Iterator[tuple[int, slice, int, int, Tensor, Tensor, Tensor, Tensor]]:
    """Every step of the tiled pass, in the same order for forward and backward: per tile [a, b) of the query
    rows after the causal rows [0, first) (absolute positions offset + a ...) and per (sequence i, KV head h),
    (i, the query heads of h, a, b, the keys some row still sees (indices cols), their keys and values
    [1, 1, nc, D], the additive mask [1, 1, groups * (b - a), nc] (0 visible, -inf hidden; the group's heads
    stacked as rows))."""
    B, H, T = ev.shape
    pos = torch.arange(T, device=ev.device)
    for a in range(first, key.shape[2] - offset, tile_rows):
        b = min(a + tile_rows, key.shape[2] - offset)
        start, stop = offset + a, offset + b
        q_pos = pos[start:stop].view(-1, 1)
        for i in range(B):
            for h in range(H):
                e = ev[i, h]
                cols = ((pos < stop) & (e > start)).nonzero().flatten()
                visible = (cols.view(1, -1) <= q_pos) & (e[cols].view(1, -1) > q_pos)
                mask = torch.zeros(visible.shape, dtype=dtype, device=ev.device).masked_fill_(~visible, float("-inf"))
                mask = mask.unsqueeze(0).expand(groups, -1, -1).reshape(1, 1, groups * (b - a), -1)
                yield (i, slice(h * groups, (h + 1) * groups), a, b, cols, key[i, h, cols][None, None],
                       value[i, h, cols][None, None], mask)


def _group_rows(x: Tensor, i: int, heads: slice, a: int, b: int) -> Tensor:
    """Rows [a, b) of the query heads `heads` of sequence i, the heads stacked as rows: [1, 1, G * t, D]."""
    return x[i, heads, a:b].reshape(1, 1, -1, x.shape[-1])


class _TiledShadow(torch.autograd.Function):
    """query [B, Hq, Q, D] (absolute rows [offset, offset + Q)), key / value [B, H, T, D], evict_at [B, H, T]
    -> out [B, Hq, Q, D] for the tiled rows [first, Q) (rows before `first` are left zero: the caller runs them
    causally)."""

    @staticmethod
    def forward(ctx, query, key, value, ev, offset: int, first: int, scale: float, tile_rows: int):
        B, Hq, Q, D = query.shape
        groups = Hq // key.shape[1]
        out = torch.zeros_like(query)
        # the kernel's log-sum-exp is float32 for float32 and lower precisions, float64 for float64 (exactness tests)
        lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        lse = torch.zeros(B, Hq, Q, dtype=lse_dtype, device=query.device)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        with torch.no_grad():
            for i, heads, a, b, _, k, v, mask in _tile_steps(key, value, ev, offset, first, tile_rows, groups,
                                                             query.dtype):
                o, log_sum_exp = flash(_group_rows(query, i, heads, a, b), k, v, 0.0, False, attn_mask=mask,
                                       scale=scale)
                out[i, heads, a:b] = o.view(groups, b - a, D)
                lse[i, heads, a:b] = log_sum_exp.view(groups, b - a)
        ctx.save_for_backward(query, key, value, ev, out, lse)
        ctx.offset, ctx.first, ctx.scale, ctx.tile_rows = offset, first, scale, tile_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, ev, out, lse = ctx.saved_tensors
        B, Hq, Q, D = query.shape
        groups = Hq // key.shape[1]
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(query)
        dk = torch.zeros_like(key)
        dv = torch.zeros_like(value)
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        for i, heads, a, b, cols, k, v, mask in _tile_steps(key, value, ev, ctx.offset, ctx.first, ctx.tile_rows,
                                                            groups, query.dtype):
            gq, gk, gv = flash_backward(_group_rows(grad_out, i, heads, a, b), _group_rows(query, i, heads, a, b), k, v,
                                        _group_rows(out, i, heads, a, b), lse[i, heads, a:b].reshape(1, 1, -1), 0.0,
                                        False, attn_mask=mask, scale=ctx.scale)
            dq[i, heads, a:b] = gq.view(groups, b - a, D)
            h = heads.start // groups
            dk[i, h].index_add_(0, cols, gk.view(-1, D))
            dv[i, h].index_add_(0, cols, gv.view(-1, D))
        return dq, dk, dv, None, None, None, None, None


def tiled_shadow_attention(query: Tensor, key: Tensor, value: Tensor, evict_at_layer: Tensor, scaling: float,
                           tile_rows: int = DEFAULT_TILE_ROWS) -> Tensor:
    """Shadow-masked attention of query [B, Hq, Q, D] — the last Q positions of the T keys (Q = T for a full
    forward, Q < T for rows continuing a cached prefix) — against key / value [B, H_kv, T, D], with
    evict_at_layer [B, H_kv, T] -> [B, Hq, Q, D]."""
    B, Hq, Q, D = query.shape
    T = key.shape[2]
    if query.device.type != "cpu":
        raise SmdInputError(f"learner.attention_backend: tiled runs PyTorch's CPU flash-attention kernel; on "
                            f"{query.device.type} use flex")
    if evict_at_layer.shape != (B, key.shape[1], T):
        raise ValueError(f"evict_at {tuple(evict_at_layer.shape)} does not cover the batch {B} x {T} tokens")
    offset = T - Q
    ev = evict_at_layer.to(torch.int64)
    # Rows before the first eviction see their whole causal prefix; from a cached prefix (offset > 0) they
    # would need the prefix keys too, so there every row is tiled.
    first = min(int(ev.min()), Q) if offset == 0 else 0
    out = _TiledShadow.apply(query, key, value, ev, offset, first, scaling, tile_rows)
    if first == 0:
        return out
    causal = F.scaled_dot_product_attention(query[:, :, :first], key[:, :, :first], value[:, :, :first],
                                            is_causal=True, scale=scaling, enable_gqa=Hq != key.shape[1])
    return torch.cat([causal, out[:, :, first:]], dim=2)
