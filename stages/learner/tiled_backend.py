"""Tiled backend of the shadow attention (`learner.attention_backend: tiled`; docs/design.md §4).

The shadow mask replayed tile by tile through PyTorch's own fused CPU flash-attention kernel
(`aten._scaled_dot_product_flash_attention_for_cpu` and its backward, the kernel behind
`F.scaled_dot_product_attention` on CPU), forward and backward. For each tile of `tile_rows` query rows and
each (sequence, KV head), only the keys that head still shows to some row of the tile are gathered — key k
with k < tile end and evict_at[k] > tile start — so evicted keys cost nothing, and the mask of the tile
(`k <= q and evict_at[k] > q`, additive 0 / -inf) covers [rows x gathered keys] only: temporaries are
O(tile_rows x T) per step, never T x T. The query heads of a KV group share its mask and keys, so they run as
one call through the kernel's own GQA (query heads [1, groups, rows, D] against one KV head, the mask broadcast
over the group: nothing repeated). The tiles split the rows evenly (no one-row tail tile), the key lists are built
once by the forward and kept for the backward, and a tile's mask is computed on its partly visible columns only
(the tile's own keys and those evicted inside it; every other gathered key is visible to every row).

Rows before the first eviction see exactly their causal prefix: they run through the dense causal kernel
(`is_causal=True`), the dense learner's own.

Why: on CPU, PyTorch has no FlexAttention backward, and its compiled FlexAttention forward measured slower than
the flash kernel on the same rows (`smdctl bench learner`); the flash kernel has a fused backward that takes
the forward's log-sum-exp, so nothing but the output and log-sum-exp is kept between the passes. On CUDA use
`flex` (FlexAttention's compiled forward and backward).

Values and gradients equal the `sdpa` reference backend's to float rounding (tests/test_tiled_backend.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from schemas.errors import SmdInputError

DEFAULT_TILE_ROWS = 256


def _tiles(first: int, rows: int, tile_rows: int) -> list[tuple[int, int]]:
    """The query tiles [a, b) over the rows [first, rows): as few as `tile_rows` allows, of near-equal sizes (257 rows
    are 128 + 129, not 256 + 1: a one-row tile gathers every key for one row)."""
    n = rows - first
    if n <= 0:
        return []
    count = -(-n // tile_rows)
    bounds = [first + j * n // count for j in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _plan(ev: Tensor, offset: int, first: int, rows: int, tile_rows: int) -> list[tuple[int, int, int, int, Tensor, Tensor]]:
    """Every step of the tiled pass, in the order forward and backward both run it: per (sequence i, KV head h) and
    per tile [a, b) of its query rows after the causal rows [0, first) (absolute positions offset + a ...), (i, h,
    a, b, the keys some row of the tile still sees (indices `cols`: k < tile end and evict_at[k] > tile start),
    the positions in `cols` of the keys some row of the tile does not see (`partial`: the tile's own keys, causal,
    and the keys evicted inside the tile)). The rows of (i, h) before its first eviction (the last prompt row when
    the rows continue a cached prompt) form tiles of their own: the many keys a prefill's compression evicts at
    once are then gathered for those rows only, not for the whole tile after them. Built once by the forward and
    kept for the backward (index lists only: O(keys) per step)."""
    B, H, T = ev.shape
    pos = torch.arange(T, device=ev.device)
    # the first row of (i, h) whose keys are not all visible (keys hidden from every row here do not count)
    lead = (torch.where(ev > offset, ev, T + offset + rows).amin(-1) - offset).clamp(first, rows).tolist()
    steps = []
    for i in range(B):
        for h in range(H):
            e = ev[i, h]
            for a, b in _tiles(first, lead[i][h], tile_rows) + _tiles(lead[i][h], rows, tile_rows):
                start, stop = offset + a, offset + b
                cols = ((pos < stop) & (e > start)).nonzero().flatten()
                # every row q of the tile (start <= q < stop) sees key k < start with evict_at[k] >= stop
                partial = ((cols >= start) | (e.index_select(0, cols) < stop)).nonzero().flatten()
                steps.append((i, h, a, b, cols, partial))
    return steps


def _tile_mask(ev: Tensor, i: int, h: int, start: int, stop: int, cols: Tensor, partial: Tensor,
               dtype: torch.dtype) -> Tensor:
    """The additive mask [1, 1, stop - start, len(cols)] of one step (0 visible, -inf hidden: query q sees key k iff
    k <= q and evict_at[k] > q), computed on the `partial` columns only (every other column is visible to every
    row), broadcast by the kernel over the KV group's query heads."""
    mask = torch.zeros(stop - start, cols.numel(), dtype=dtype, device=ev.device)
    if partial.numel():
        k = cols.index_select(0, partial).view(1, -1)
        q_pos = torch.arange(start, stop, device=ev.device).view(-1, 1)
        visible = (k <= q_pos) & (ev[i, h].index_select(0, k.view(-1)).view(1, -1) > q_pos)
        mask[:, partial] = torch.zeros(visible.shape, dtype=dtype, device=ev.device).masked_fill_(~visible,
                                                                                                float("-inf"))
    return mask.view(1, 1, stop - start, -1)


def _prefix_splits(steps, prefix_len: int) -> list[int]:
    """Per step, how many of its gathered keys `cols` (ascending) lie in a shared prefix of `prefix_len` positions."""
    return [int(torch.searchsorted(cols, prefix_len)) for _, _, _, _, cols, _ in steps]


def _gather(x: Tensor, prefix: Tensor | None, prefix_rows: tuple[int, ...] | None, i: int, h: int, cols: Tensor,
            split: int) -> Tensor:
    """Row i / KV head h's keys (or values) at positions `cols`: from x [B, H, T, D] alone, or, with a shared
    prefix [R, H, S, D], positions < S from row i's prefix `prefix_rows[i]` and the rest from x (offset by S)."""
    if prefix is None:
        return x[i, h].index_select(0, cols)
    S = prefix.shape[2]
    if split == 0:
        return x[i, h].index_select(0, cols - S)
    if split == cols.numel():
        return prefix[prefix_rows[i], h].index_select(0, cols)
    return torch.cat([prefix[prefix_rows[i], h].index_select(0, cols[:split]),
                      x[i, h].index_select(0, cols[split:] - S)])


def _scatter_add(dx: Tensor, dprefix: Tensor | None, prefix_rows: tuple[int, ...] | None, i: int, h: int,
                 cols: Tensor, split: int, grad: Tensor) -> None:
    """The inverse of `_gather`: add `grad` [len(cols), D] into row i / head h of dx, or of its shared prefix."""
    if dprefix is None:
        dx[i, h].index_add_(0, cols, grad)
        return
    S = dprefix.shape[2]
    if split:
        dprefix[prefix_rows[i], h].index_add_(0, cols[:split], grad[:split])
    if split < cols.numel():
        dx[i, h].index_add_(0, cols[split:] - S, grad[split:])


class _TiledShadow(torch.autograd.Function):
    """query [B, Hq, Q, D] (absolute rows [offset, offset + Q)), key / value [B, H, T, D], evict_at [B, H, T]
    -> out [B, Hq, Q, D] for the tiled rows [first, Q) (rows before `first` are left zero: the caller runs them
    causally). Each step is one kernel call of the KV group's query heads [1, groups, rows, D] against its one
    KV head's gathered keys [1, 1, keys, D] (the kernel's own GQA: no copy of the mask or the queries per head).

    With a shared prefix (prefix_key / prefix_value [R, H, S, D], `prefix_rows`: row i reads prefix
    prefix_rows[i]) the keys of row i are its prefix's S positions followed by key[i]'s: a GRPO group's G rows read
    their prompt's one copy (its gradient sums their G contributions), where a [G, H, S + T, D] concatenation would
    hold and keep it G times for the backward."""

    @staticmethod
    def forward(ctx, query, key, value, prefix_key, prefix_value, prefix_rows, ev, offset: int, first: int,
                scale: float, tile_rows: int):
        B, Hq, Q, D = query.shape
        groups = Hq // key.shape[1]
        out = torch.zeros_like(query)
        # the kernel's log-sum-exp is float32 for float32 and lower precisions, float64 for float64 (exactness tests)
        lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        lse = torch.zeros(B, Hq, Q, dtype=lse_dtype, device=query.device)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        steps = _plan(ev, offset, first, Q, tile_rows)
        splits = _prefix_splits(steps, prefix_key.shape[2]) if prefix_key is not None else [0] * len(steps)
        with torch.no_grad():
            for (i, h, a, b, cols, partial), split in zip(steps, splits):
                heads = slice(h * groups, (h + 1) * groups)
                mask = _tile_mask(ev, i, h, offset + a, offset + b, cols, partial, query.dtype)
                k = _gather(key, prefix_key, prefix_rows, i, h, cols, split)[None, None]
                v = _gather(value, prefix_value, prefix_rows, i, h, cols, split)[None, None]
                o, log_sum_exp = flash(query[i:i + 1, heads, a:b], k, v, 0.0, False, attn_mask=mask, scale=scale)
                out[i, heads, a:b] = o[0]
                lse[i, heads, a:b] = log_sum_exp[0]
        ctx.save_for_backward(query, key, value, prefix_key, prefix_value, ev, out, lse)
        ctx.offset, ctx.scale, ctx.steps, ctx.splits, ctx.prefix_rows = offset, scale, steps, splits, prefix_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, prefix_key, prefix_value, ev, out, lse = ctx.saved_tensors
        B, Hq, Q, D = query.shape
        groups = Hq // key.shape[1]
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(query)
        dk = torch.zeros_like(key)
        dv = torch.zeros_like(value)
        dpk = torch.zeros_like(prefix_key) if prefix_key is not None else None
        dpv = torch.zeros_like(prefix_value) if prefix_value is not None else None
        rows = ctx.prefix_rows
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        offset = ctx.offset
        for (i, h, a, b, cols, partial), split in zip(ctx.steps, ctx.splits):
            heads = slice(h * groups, (h + 1) * groups)
            mask = _tile_mask(ev, i, h, offset + a, offset + b, cols, partial, query.dtype)
            k = _gather(key, prefix_key, rows, i, h, cols, split)[None, None]
            v = _gather(value, prefix_value, rows, i, h, cols, split)[None, None]
            gq, gk, gv = flash_backward(grad_out[i:i + 1, heads, a:b], query[i:i + 1, heads, a:b], k, v,
                                        out[i:i + 1, heads, a:b], lse[i:i + 1, heads, a:b], 0.0, False,
                                        attn_mask=mask, scale=ctx.scale)
            dq[i, heads, a:b] = gq[0]
            _scatter_add(dk, dpk, rows, i, h, cols, split, gk.view(-1, D))
            _scatter_add(dv, dpv, rows, i, h, cols, split, gv.view(-1, D))
        return dq, dk, dv, dpk, dpv, None, None, None, None, None, None


def tiled_shadow_attention(query: Tensor, key: Tensor, value: Tensor, evict_at_layer: Tensor, scaling: float,
                           tile_rows: int = DEFAULT_TILE_ROWS, prefix: tuple[Tensor, Tensor] | None = None,
                           prefix_rows: list[int] | None = None) -> Tensor:
    """Shadow-masked attention of query [B, Hq, Q, D] — the last Q positions of the T keys (Q = T for a full
    forward, Q < T for rows continuing a cached prefix) — against key / value [B, H_kv, T, D], with
    evict_at_layer [B, H_kv, T] -> [B, Hq, Q, D].

    `prefix`: keys and values [R, H_kv, S, D] shared by rows (a GRPO group's prompt, `shared_prompt_hidden`), row i
    reading prefix `prefix_rows[i]` (default 0); the keys of row i are then its prefix's S positions followed by
    key[i]'s, T = S + key's length, and evict_at_layer covers all T. Equal to the same call on the concatenation
    (tests/test_tiled_backend.py), without it: the rows' prefix keys and values are never copied per row."""
    B, Hq, Q, D = query.shape
    T = key.shape[2] + (prefix[0].shape[2] if prefix is not None else 0)
    if query.device.type != "cpu":
        raise SmdInputError(f"learner.attention_backend: tiled runs PyTorch's CPU flash-attention kernel; on "
                            f"{query.device.type} use flex")
    if evict_at_layer.shape != (B, key.shape[1], T):
        raise ValueError(f"evict_at {tuple(evict_at_layer.shape)} does not cover the batch {B} x {T} tokens")
    offset = T - Q
    ev = evict_at_layer.to(torch.int64)
    if prefix is not None:
        rows = tuple(prefix_rows) if prefix_rows is not None else (0,) * B
        if len(rows) != B or not all(0 <= r < prefix[0].shape[0] for r in rows):
            raise ValueError(f"prefix_rows {rows} does not map the batch's {B} rows to the {prefix[0].shape[0]} "
                             "prefixes")
        return _TiledShadow.apply(query, key, value, prefix[0], prefix[1], rows, ev, offset, 0, scaling, tile_rows)
    # Rows before the first eviction see their whole causal prefix; from a cached prefix (offset > 0) they
    # would need the prefix keys too, so there every row is tiled.
    first = min(int(ev.min()), Q) if offset == 0 else 0
    out = _TiledShadow.apply(query, key, value, None, None, None, ev, offset, first, scaling, tile_rows)
    if first == 0:
        return out
    causal = F.scaled_dot_product_attention(query[:, :, :first], key[:, :, :first], value[:, :, :first],
                                            is_causal=True, scale=scaling, enable_gqa=Hq != key.shape[1])
    return torch.cat([causal, out[:, :, first:]], dim=2)
