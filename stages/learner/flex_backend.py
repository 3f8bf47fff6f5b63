"""FlexAttention backend of the shadow attention: a BlockMask built straight from evict_at (docs/design.md §4).

The [query x key] mask is never materialised. Per (batch, KV head) and key block j, the min and max of
evict_at over the block decide, for every query block i (block size `bs`):

  empty    j > i (causal), or max evict_at[block j] <= i*bs (every key of j is gone before block i starts)
  full     j < i and min evict_at[block j] >= (i+1)*bs (every key of j is still visible at the end of i)
  partial  otherwise: the per-element `mask_mod` `(kv <= q) & (evict_at[b, h // groups, kv] > q)` decides

Mask memory is O(T) for evict_at plus O((T/bs)^2) block indices per head. Sequences are padded to a
multiple of the block size; padding key k carries evict_at = k + 1 (seen only by itself, so every query
row has at least one visible key and the softmax stays finite).

Causal prefix: eviction is monotone and starts after prefill, so every query before the first eviction
(q < min evict_at over the micro-batch) sees exactly its causal prefix. Those rows — rounded down to a
whole block — run through the dense causal kernel (`scaled_dot_product_attention(is_causal=True)`, the
dense learner's own kernel); FlexAttention runs the remaining query rows against all keys, with the block
mask's query blocks starting there (the offset enters `mask_mod` as a tensor). A micro-batch with no
eviction (a dense rollout) never calls FlexAttention.

Gradients: on CUDA, FlexAttention's own (compiled) backward. PyTorch has no FlexAttention backward on CPU
(and no log-sum-exp output from its CPU kernel), so on CPU the forward runs the compiled FlexAttention
kernel and `_FlexShadowCPU.backward` recomputes the attention one query tile at a time over the keys
that tile still sees (temporaries O(tile x T) per layer, never T x T).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from stages.common.compile_cache import key_compile_caches_to_cpu_isa

DEFAULT_BLOCK_SIZE = 128
BACKWARD_TILE = 64  # query rows per step of the CPU backward

_compiled: dict[str, Any] = {}
_lock = threading.Lock()


def _patch_cpu_flex_symbol_names() -> bool:
    """Work around a name clash in torch 2.13's CPU FlexAttention code generation (Inductor C++ template).

    `CppFlexAttentionTemplate.modification` renames the two runtime tile sizes in the generated mask code with a
    plain `str.replace` of their kernel names, e.g. "ks1" -> "cur_kvSplitSize". When a size the mask_mod reads
    (here evict_at's key length, named after its dynamic symbol, e.g. "ks17") starts with the same characters, it
    is mangled too ("cur_kvSplitSize7": `CppCompileError ... was not declared in this scope`). Which symbol
    numbers a graph gets depends on the shapes (it hit the learn stage on micro-batches of 8 sequences shorter
    than one 128-token block). The patch runs the original method with the renaming turned off and renames whole
    identifiers only (regex word boundaries). Applied once, only where the method exists; returns whether it is
    in place. torch is pinned (pyproject.toml), so the patched method is the one read here.
    """
    import re

    try:
        import sympy
        import torch._inductor.compile_fx  # noqa: F401  (first: the template module alone is a circular import)
        from torch._inductor.codegen import cpp as inductor_cpp
        from torch._inductor.codegen.cpp_flex_attention_template import CppFlexAttentionTemplate
    except ImportError:  # another torch layout: nothing to patch
        return False
    original = getattr(CppFlexAttentionTemplate, "modification", None)
    if original is None or not hasattr(inductor_cpp, "KernelGroup"):  # another torch (>= 2.11 is supported)
        return False
    if getattr(original, "_smd_patched", False):
        return True
    base_group = inductor_cpp.KernelGroup
    groups: list[Any] = []

    class RecordingKernelGroup(base_group):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            groups.append(self)

    def modification(self, subgraph_buffer, output_name, output_idx):
        block_vars = self.block_vars
        self.block_vars = (sympy.Symbol("smd_unused_q"), sympy.Symbol("smd_unused_kv"))  # no str.replace
        inductor_cpp.KernelGroup = RecordingKernelGroup
        groups.clear()
        try:
            code = original(self, subgraph_buffer, output_name, output_idx)
        finally:
            inductor_cpp.KernelGroup = base_group
            self.block_vars = block_vars
        sizevars = groups[-1].args.sizevars
        for var, name in zip(block_vars, ("cur_qSplitSize", "cur_kvSplitSize")):
            if var in sizevars:
                code = re.sub(rf"\b{re.escape(sizevars[var])}\b", name, code)
        return code

    modification._smd_patched = True  # type: ignore[attr-defined]
    CppFlexAttentionTemplate.modification = modification
    return True


def _flex():
    """torch.compile(flex_attention) once per process (dynamic shapes: no recompilation per length).

    Every call first keys torch.compile's on-disk caches to the CPU vector ISA (`stages.common.compile_cache`):
    a CPU kernel Inductor generated under another `ATEN_CPU_CAPABILITY` and left in a shared cache directory
    otherwise came back on a cache hit and computed wrong attention."""
    with _lock:
        key_compile_caches_to_cpu_isa()  # cheap; before any (re)compilation the returned function may do
        if "fn" not in _compiled:
            import torch._dynamo

            _patch_cpu_flex_symbol_names()
            from torch.nn.attention.flex_attention import flex_attention

            # Past the recompile limit dynamo silently runs flex_attention eagerly, which materialises the full
            # score matrix. Batch size (first 1, then dynamic) and block size add a few graphs; leave room.
            cfg = torch._dynamo.config
            if hasattr(cfg, "recompile_limit"):
                cfg.recompile_limit = max(cfg.recompile_limit, 64)
            _compiled["fn"] = torch.compile(flex_attention, dynamic=True)
        return _compiled["fn"]


def padded_length(T: int, block_size: int) -> int:
    return -(-T // block_size) * block_size


def pad_evict_at_to(evict_at: Tensor, Tp: int) -> Tensor:
    """Pad the key axis (last) of evict_at [..., T] to Tp; padding key k gets k + 1."""
    T = evict_at.shape[-1]
    if Tp == T:
        return evict_at
    tail = torch.arange(T, Tp, device=evict_at.device, dtype=evict_at.dtype) + 1
    return torch.cat([evict_at, tail.expand(*evict_at.shape[:-1], Tp - T)], dim=-1)


def block_structure(evict_at_layer: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Non-empty and full block flags [B, H_kv, n, n] (query block i, key block j) from evict_at [B, H_kv, Tp]."""
    B, H, Tp = evict_at_layer.shape
    n = Tp // block_size
    blocks = evict_at_layer.view(B, H, n, block_size)
    ev_max = blocks.amax(dim=-1)  # [B, H, n] per key block
    ev_min = blocks.amin(dim=-1)
    i = torch.arange(n, device=evict_at_layer.device).view(n, 1)
    j = torch.arange(n, device=evict_at_layer.device).view(1, n)
    causal = j <= i  # [n, n]
    q_start = (i * block_size).view(1, 1, n, 1)
    q_end = ((i + 1) * block_size).view(1, 1, n, 1)
    nonempty = causal & (ev_max.unsqueeze(2) > q_start)
    full = (j < i) & (ev_min.unsqueeze(2) >= q_end)
    return nonempty, full


def _to_indices(flags: Tensor) -> tuple[Tensor, Tensor]:
    """bool [..., n, n] -> (count [..., n] int32, indices [..., n, n] int32, the set blocks first in order)."""
    num = flags.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, order


@dataclass
class ShadowBlockMask:
    """One layer's mask: query rows [0, prefix) are plain causal; rows [prefix, length) use `block_mask`."""

    evict_at: Tensor  # [B, H_kv, length] padded
    length: int  # padded sequence length (a multiple of block_size)
    prefix: int  # causal rows, a multiple of block_size
    block_size: int
    block_mask: Any | None  # FlexAttention BlockMask over query rows [prefix, length) x keys [0, length)


def build_block_mask(evict_at_layer: Tensor, num_q_heads: int, block_size: int = DEFAULT_BLOCK_SIZE,
                     prefix: int | None = None) -> ShadowBlockMask:
    """The FlexAttention BlockMask of one layer from evict_at [B, H_kv, T] (padded to a block multiple).

    `prefix` (a multiple of block_size, at most the first eviction position): the query rows the mask starts
    at; default the first eviction position rounded down to a block. Rows before it are plain causal."""
    from torch.nn.attention.flex_attention import BlockMask

    B, H, T = evict_at_layer.shape
    Tp = padded_length(T, block_size)
    ev = pad_evict_at_to(evict_at_layer.to(torch.int64), Tp).contiguous()
    first_eviction = int(ev.min())
    if prefix is None:
        prefix = min(first_eviction // block_size * block_size, Tp)
    elif prefix % block_size or prefix > first_eviction or prefix >= Tp:
        raise ValueError(f"prefix {prefix}: must be a multiple of {block_size}, <= {first_eviction} and < {Tp}")
    if prefix >= Tp:
        return ShadowBlockMask(ev, Tp, Tp, block_size, None)
    groups = num_q_heads // H
    nonempty, full = block_structure(ev, block_size)
    first = prefix // block_size
    partial = (nonempty & ~full)[:, :, first:]
    full = full[:, :, first:]
    if groups > 1:  # the block mask is per query head; the mask is shared inside a KV group
        partial = partial.repeat_interleave(groups, dim=1)
        full = full.repeat_interleave(groups, dim=1)
    kv_num, kv_idx = _to_indices(partial)
    full_num, full_idx = _to_indices(full)

    # kv_head[h] = h // groups and the query offset as tensors: a Python int captured by mask_mod becomes a
    # dynamic symbol under torch.compile(dynamic=True), which the CPU FlexAttention template of torch 2.13
    # fails to compile.
    kv_head = torch.arange(num_q_heads, device=ev.device) // groups
    offset = torch.tensor(prefix, device=ev.device)

    def mask_mod(b, h, q_idx, kv_idx):
        q = q_idx + offset
        return (kv_idx <= q) & (ev[b, kv_head[h], kv_idx] > q)

    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(Tp - prefix, Tp))
    return ShadowBlockMask(ev, Tp, prefix, block_size, mask)


def build_block_masks(evict_at: Tensor, num_q_heads: int, block_size: int = DEFAULT_BLOCK_SIZE,
                      prefix: int | None = None) -> list[ShadowBlockMask]:
    """One mask per layer from evict_at [L, B, H_kv, T] (build once per micro-batch, reuse for all passes)."""
    return [build_block_mask(evict_at[layer], num_q_heads, block_size, prefix) for layer in range(evict_at.shape[0])]


def _pad_seq(x: Tensor, Tp: int) -> Tensor:
    T = x.shape[-2]
    return x if T == Tp else F.pad(x, (0, 0, 0, Tp - T))


class _FlexShadowCPU(torch.autograd.Function):
    """Forward: compiled FlexAttention of query rows [prefix, Tp). Backward: tiled recomputation in torch
    (CPU has no flex backward): each query tile gathers only the keys some query of the tile still sees in
    some (batch, head) — k < tile end and evict_at[k] > tile start — so evicted keys cost nothing."""

    @staticmethod
    def forward(ctx, query, key, value, mask: ShadowBlockMask, scaling):
        with torch.no_grad():
            out = _flex()(query.detach(), key.detach(), value.detach(), block_mask=mask.block_mask, scale=scaling,
                          enable_gqa=query.shape[1] != key.shape[1])
        ctx.save_for_backward(query, key, value)
        ctx.mask = mask
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value = ctx.saved_tensors
        ev, offset = ctx.mask.evict_at, ctx.mask.prefix  # [B, H, Tp]; query row i is position offset + i
        scale = ctx.scaling
        B, Hq, Q, D = query.shape
        H, Tp = key.shape[1], key.shape[2]
        G = Hq // H
        q = query.reshape(B, H, G, Q, D)
        do = grad_out.reshape(B, H, G, Q, -1)
        dq = torch.empty_like(q)
        dk = torch.zeros_like(key)
        dv = torch.zeros_like(value)
        pos = torch.arange(Tp, device=query.device)
        ev_flat = ev.reshape(B * H, Tp)
        for start in range(0, Q, BACKWARD_TILE):
            stop = min(start + BACKWARD_TILE, Q)
            cols = ((pos < offset + stop) & (ev_flat > offset + start)).any(dim=0).nonzero().flatten()
            k_s, v_s = key[:, :, cols].unsqueeze(2), value[:, :, cols].unsqueeze(2)  # [B, H, 1, nc, D]
            q_pos = pos[offset + start : offset + stop].view(-1, 1)
            visible = (cols.view(1, -1) <= q_pos) & (ev[:, :, cols].unsqueeze(2) > q_pos)  # [B, H, t, nc]
            q_i, do_i = q[:, :, :, start:stop], do[:, :, :, start:stop]  # [B, H, G, t, D]
            s = torch.matmul(q_i, k_s.transpose(-1, -2)).mul_(scale)
            s.masked_fill_(~visible.unsqueeze(2), float("-inf"))
            p = torch.softmax(s, dim=-1)
            del s
            dv.index_add_(2, cols, torch.matmul(p.transpose(-1, -2), do_i).sum(dim=2))
            dp = torch.matmul(do_i, v_s.transpose(-1, -2))
            ds = dp.sub_((dp * p).sum(dim=-1, keepdim=True)).mul_(p)
            del dp, p
            dq[:, :, :, start:stop] = torch.matmul(ds, k_s).mul_(scale)
            dk.index_add_(2, cols, torch.matmul(ds.transpose(-1, -2), q_i).mul_(scale).sum(dim=2))
        return dq.view(B, Hq, Q, D), dk, dv, None, None


def _flex_rows(q: Tensor, k: Tensor, v: Tensor, mask: ShadowBlockMask, scaling: float) -> Tensor:
    """Shadow attention of query rows q = rows [prefix, Tp) against all keys (FlexAttention)."""
    gqa = q.shape[1] != k.shape[1]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if q.device.type != "cpu":
        return _flex()(q, k, v, block_mask=mask.block_mask, scale=scaling, enable_gqa=gqa)
    if needs_grad:
        return _FlexShadowCPU.apply(q, k, v, mask, scaling)
    # No gradient wanted: CPU FlexAttention refuses inputs that require grad.
    return _flex()(q.detach(), k.detach(), v.detach(), block_mask=mask.block_mask, scale=scaling, enable_gqa=gqa)


def flex_shadow_attention(query: Tensor, key: Tensor, value: Tensor, evict_at_layer: Tensor, scaling: float,
                          block_masks: list | None = None, layer: int = 0,
                          block_size: int = DEFAULT_BLOCK_SIZE) -> Tensor:
    """Shadow-masked attention: query [B, Hq, T, D], key/value [B, H_kv, T, D], evict_at_layer [B, H_kv, T]
    -> [B, Hq, T, D]. `block_masks` (from `build_block_masks`) avoids rebuilding the layer's mask; without it
    the mask is built here with `block_size`."""
    B, Hq, Tq, D = query.shape
    T = key.shape[2]
    mask = block_masks[layer] if block_masks is not None else build_block_mask(evict_at_layer, Hq, block_size)
    Tp, prefix = mask.length, mask.prefix
    if Tp < T or Tp % mask.block_size or tuple(mask.evict_at.shape[:2]) != (B, key.shape[1]):
        raise ValueError(f"block mask ({tuple(mask.evict_at.shape)}) does not cover the batch {B} x {T} tokens")
    k, v = _pad_seq(key, Tp), _pad_seq(value, Tp)
    if Tq < T:  # the query rows [T - Tq, T) continue a cached prefix: they must be the mask's rows
        if T - Tq != prefix:
            raise ValueError(f"query rows start at {T - Tq}, the block mask's at {prefix}")
        return _flex_rows(_pad_seq(query, Tp - prefix), k, v, mask, scaling)[:, :, :Tq]
    q = _pad_seq(query, Tp)
    gqa = Hq != key.shape[1]
    parts = []
    if prefix > 0:  # rows before the first eviction: plain causal attention
        parts.append(F.scaled_dot_product_attention(q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix],
                                                    is_causal=True, scale=scaling, enable_gqa=gqa))
    if prefix < Tp:  # contiguous: a strided view would add a compiled graph
        parts.append(_flex_rows(q[:, :, prefix:].contiguous(), k, v, mask, scaling))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out[:, :, :T]
