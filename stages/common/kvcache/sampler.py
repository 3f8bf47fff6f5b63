"""Batched sampling on Hugging Face transformers with an evicting KV cache and exact shadow-mask recording.

How it plugs into transformers:
- `EvictingCache` is a `transformers.Cache` whose layers keep a fixed number of physical slots per
  (sequence, KV head): the budget at the longest length, never more. Keys are stored after RoPE, so an
  evicted key's neighbours keep their original positions (decoding passes explicit `position_ids`).
- The attention function `smd_rollout` (registered through `AttentionInterface`) masks empty slots,
  computes the attention probabilities a policy asks for, lets the policy score the slots, and evicts
  right after the layer's attention ran: a step's visible set is the cache content when it runs.
- Every eviction writes `evict_at[layer, seq, head, pos] = query_pos + 1` (docs/design.md §4).

Devices (docs/design.md, Devices): every tensor lives on the model's device. The budget schedule of the batch
is computed on the host before it runs (`stages.common.kvcache.schedule`); the decode loop keeps tokens, log-probs
and stop flags as device tensors and syncs with the host only for its stop check, every
`stop_check_every` steps (the extra steps after every sequence stopped are masked out, so the results do
not depend on it); the host copies the trajectories and `evict_at` once, at the end of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from schemas.params.rollout import EvictionParams
from schemas.raw_masks import visible_counts
from stages.common.compile_cache import key_compile_caches_to_cpu_isa
from stages.common.kvcache.policies import EvictionPolicy, LayerSlots, evict, make_policy
from stages.common.kvcache.schedule import BudgetSchedule, budget_schedule
from stages.common.model import attention_implementation

ROLLOUT_ATTENTION = "smd_rollout"
_PREFILL_CHUNK = 64  # query chunk for attention-probability passes (bounds memory at long prompts)


@dataclass
class RolloutState:
    """Everything the attention function needs to know about the current forward pass."""

    policy: EvictionPolicy
    eviction: dict[str, Any]
    num_layers: int
    schedule: BudgetSchedule  # host: keep counts and excess per step, computed before the batch runs
    prompt_lens: torch.Tensor  # [B] on the device
    prompt_lens_host: np.ndarray  # [B] the same on the host
    evict_at: torch.Tensor  # [L, B, H, T_max] int32 on the device, -1 = never evicted
    phase: str = "prefill"
    # Left padding of each prompt [B] (device), and whether any prompt is padded (host): an unpadded prefill
    # runs SDPA causal with no mask (the fused kernels), a padded one with the explicit mask.
    prompt_pad: torch.Tensor | None = None
    padded: bool = False
    current_pos: torch.Tensor | None = None  # [B] position of the query being decoded
    seq_length: int = 0  # host: cached positions of the longest row (what transformers asks of the cache)
    slots: list[LayerSlots | None] = field(default_factory=list)
    step_keep: torch.Tensor | None = None  # the current decoding step's keep count per sequence [B]
    step_window: torch.Tensor | None = None  # the policy's recent window for step_keep [B]
    # Most keys any sequence is over its keep count this step (0: no layer evicts; 1 in decoding), from the
    # schedule on the host instead of a tensor check in every layer.
    step_excess: int = 0
    # Shared prompts (docs/design.md §3c): the prefill forward runs on the distinct prompts only. `prefill_rows`
    # [B]: the distinct prompt each row takes its prefill from; `prefill_first` [U]: a row of each distinct
    # prompt; None: every row prefills its own prompt (no prompt repeats, or rollout.share_prompt false).
    prefill_rows: torch.Tensor | None = None
    prefill_first: torch.Tensor | None = None
    # Left padding of the rows the prefill forward runs ([U] when shared, else prompt_pad).
    prefill_pad: torch.Tensor | None = None
    # Shared prompt storage (prompt_slots > 0: shared prompts, where it saves bytes): each layer stores a
    # distinct prompt's kept slots once, [U, H, prompt_slots, D], and every row its own `decode_slots` slots
    # [B, H, decode_slots, D]. A row's LayerSlots cover both, prompt slots first: its visibility over its prompt's slots (-1 = not stored for
    # this prompt, or evicted by this row), then its own. `group_rows` [U, n]: the rows of each distinct prompt
    # (padded with its first row); `group_index` [B]: where each row sits in `group_rows` flattened.
    prompt_slots: int = 0
    decode_slots: int = 0
    group_rows: torch.Tensor | None = None
    group_index: torch.Tensor | None = None
    # A policy that observes its last `window` queries at an eviction (`decode_observation` "window_queries"):
    # each layer's last queries [B, Hq, window, D] (after RoPE), their positions [B, window] (-1 = none yet),
    # and the entry the next step writes, a device tensor (a compiled step must not specialise on it).
    # Chunked prefill (`rollout.prefill_chunk_tokens`, `layerwise_prefill`): the chunk a layer runs now, (first
    # row, end row, first query, end query) of the prefill's rows, host ints; None = the whole prompt at once.
    # `prefill_group`: the prefill rows (first, end) now going through every layer, the chunk's rows among them.
    # `prefill_obs` accumulates the layer's observed attention over its chunks (H2O: column sums [rows, H, 1, P];
    # SnapKV: its observation window's queries [rows, Hq, w, D]; rows: the group's).
    prefill_chunk: tuple[int, int, int, int] | None = None
    prefill_group: tuple[int, int] | None = None
    prefill_group_rows: torch.Tensor | None = None  # the batch rows whose prompt is in the group [n] (device)
    prefill_obs: torch.Tensor | None = None
    window_queries: list[torch.Tensor | None] = field(default_factory=list)
    window_pos: torch.Tensor | None = None
    window_entry: torch.Tensor | None = None
    # Host: whether any decoding step of the batch evicts (the schedule's excess), computed once per batch.
    decode_evicts: bool = True

    @property
    def capacity(self) -> int:
        return self.schedule.capacity

    @property
    def shares_storage(self) -> bool:
        """Whether the batch's prompts are stored once per distinct prompt (`prompt_slots`)."""
        return self.prompt_slots > 0

    @property
    def device(self) -> torch.device:
        return self.prompt_lens.device

    @property
    def evicts_while_decoding(self) -> bool:
        return self.policy.evicts and self.eviction.get("compress", "every_step") == "every_step"

    @property
    def decode_observation(self) -> str:
        """What the policy observes while decoding: "none" when no decoding step of the batch evicts (the policy
        evicts at prefill only, or every response ends before the first eviction of an interval), since only an
        eviction reads an observation. So a GRPO batch of short responses at `interval` 64 buffers no queries."""
        return self.policy.decode_observation() if self.evicts_while_decoding and self.decode_evicts else "none"

    def prefill_mask(self, q_start: int, q_end: int, k_end: int, rows: slice = slice(None)) -> torch.Tensor:
        """Bool mask [B or 1, 1, q_end - q_start, k_end] of prompt queries q_start..q_end over keys 0..k_end of
        the left-padded rows the prefill forward runs (B, or the U distinct prompts when shared; `rows` of them):
        causal, padding keys hidden, padding queries see themselves (finite softmax)."""
        q = torch.arange(q_start, q_end, device=self.device)
        k = torch.arange(k_end, device=self.device)
        causal = k[None, :] <= q[:, None]
        if not self.padded:
            return causal[None, None]
        real_key = k[None, :] >= self.prefill_pad[rows, None]  # [B or U, K]
        mask = causal[None] & real_key[:, None, :]
        return (mask | (k[None, :] == q[:, None])[None])[:, None]


class EvictingLayer(CacheLayerMixin):
    """One layer's physical cache: keys/values [B, H, capacity, D] plus slot positions; with shared prompts, a
    distinct prompt's kept keys/values [U, H, prompt_slots, D] once and each row's own [B, H, decode_slots, D]."""

    is_compileable = False
    is_sliding = False

    def __init__(self, state: RolloutState, layer_idx: int, store: BatchStore):
        super().__init__()
        self.state = state
        self.layer_idx = layer_idx
        self.store = store
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.prompt_keys: torch.Tensor | None = None
        self.prompt_values: torch.Tensor | None = None

    def lazy_initialization(self, key_states, value_states):
        _, H, _, D = key_states.shape
        st = self.state
        B = len(st.prompt_lens_host)  # every row, also when the prefill ran on the distinct prompts only
        C = st.decode_slots if st.shares_storage else st.capacity
        own = self.store.view("own", self.layer_idx, (2, B, H, C, D), key_states, fill=0)
        self.keys, self.values = own[0], own[1]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        st = self.state
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if st.phase == "prefill":
            # Attention runs over the full prompt; the kept keys are copied into the slots afterwards.
            if st.prefill_chunk is None:
                self.pending = (key_states, value_states)
                return key_states, value_states
            # A chunk of a layer-by-layer prefill: its keys join the layer's prompt keys of the row group, and
            # its queries see every key of their rows up to the chunk's end.
            r0, r1, q0, q1 = st.prefill_chunk
            g0, g1 = st.prefill_group
            if r0 == g0 and q0 == 0:  # the group's first chunk in this layer
                _, H, _, D = key_states.shape
                shape = (g1 - g0, H, st.seq_length, D)
                self.pending = (key_states.new_empty(shape), value_states.new_empty(shape))
            k, v = self.pending
            k[r0 - g0:r1 - g0, :, q0:q1] = key_states
            v[r0 - g0:r1 - g0, :, q0:q1] = value_states
            return k[r0 - g0:r1 - g0, :, :q1], v[r0 - g0:r1 - g0, :, :q1]
        slots = st.slots[self.layer_idx]
        first = st.prompt_slots  # a row's own slots follow its prompt's (0 without shared prompts)
        free = slots.slot_pos[..., first:] < 0
        slot_idx = free.to(torch.int8).argmax(dim=-1)  # first free own slot per (b, h)
        B, H = slot_idx.shape
        b_idx = torch.arange(B, device=slot_idx.device).repeat_interleave(H)
        h_idx = torch.arange(H, device=slot_idx.device).repeat(B)
        s_idx = slot_idx.reshape(-1)
        self.keys[b_idx, h_idx, s_idx] = key_states[:, :, 0].reshape(B * H, -1)
        self.values[b_idx, h_idx, s_idx] = value_states[:, :, 0].reshape(B * H, -1)
        slots.slot_pos[b_idx, h_idx, s_idx + first] = st.current_pos[b_idx]
        st.policy.on_insert(self.layer_idx, slots, b_idx, h_idx, s_idx + first)
        return self.keys, self.values

    def finish_prefill(self, keep_idx: torch.Tensor, rows: torch.Tensor | None = None,
                       dest: torch.Tensor | None = None) -> None:
        """Copy the kept prompt keys (indices into the prompt axis, [B or U, H, C]) into each row's slots.

        `rows` [B]: the prefill ran on U distinct prompts (pending keys [U, H, P, D]) and row b takes prompt
        rows[b]. A selection per distinct prompt ([U, H, C]) is gathered once, then copied to its rows; a
        selection per row ([B, H, C], random eviction's own draws) gathers from its prompt's keys. `dest`: the
        batch rows these are (a row group of `layerwise_prefill`; pending, `rows` and `keep_idx` are the group's),
        None: every row."""
        k, v = self.pending
        D = k.shape[-1]
        idx = keep_idx.unsqueeze(-1).expand(-1, -1, -1, D)
        if rows is not None and keep_idx.shape[0] == len(rows):  # a selection per row over the shared prompts
            k, v = k.index_select(0, rows), v.index_select(0, rows)
        kept_k, kept_v = torch.gather(k, 2, idx), torch.gather(v, 2, idx)
        if rows is not None and keep_idx.shape[0] != len(rows):  # one selection per distinct prompt
            kept_k, kept_v = kept_k.index_select(0, rows), kept_v.index_select(0, rows)
        if dest is None:
            self.keys.copy_(kept_k)
            self.values.copy_(kept_v)
        else:
            self.keys.index_copy_(0, dest, kept_k)
            self.values.index_copy_(0, dest, kept_v)
        self.pending = None

    def store_prompts(self, keep_idx: torch.Tensor | None, group: tuple[int, int] | None = None) -> None:
        """Shared prompts: keep each distinct prompt's kept keys once (indices into the prompt axis [U, H,
        prompt_slots]; None keeps the whole prompt, for a policy whose rows select on their own). `group`: the
        distinct prompts (first, end) of U these are (a row group of `layerwise_prefill`), None: all of them."""
        k, v = self.pending
        self.pending = None
        if keep_idx is not None:
            idx = keep_idx.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
            k, v = torch.gather(k, 2, idx), torch.gather(v, 2, idx)
        g0, g1 = group or (0, len(k))
        if g0 == 0:  # the first group: the storage of every distinct prompt
            stored = self.store.view("prompt", self.layer_idx, (2, len(self.state.prefill_pad), *k.shape[1:]), k)
            self.prompt_keys, self.prompt_values = stored[0], stored[1]
        self.prompt_keys[g0:g1] = k
        self.prompt_values[g0:g1] = v

    def get_seq_length(self) -> int:
        return self.state.seq_length  # host-side: asking the device would sync every layer

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.capacity, 0

    def get_max_length(self) -> int:
        return self.state.capacity

    def nbytes(self) -> int:
        own = 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
        return own + (0 if self.prompt_keys is None else self.prompt_keys.nbytes + self.prompt_values.nbytes)


class BatchStore:
    """What a batch keeps for its whole run, every layer's in one block per kind: the rows' own keys and values,
    the distinct prompts' kept keys and values, the slot positions. A layer's tensor is a view of its block's
    entry, allocated when the first layer asks (vLLM likewise allocates its KV cache once, not per request).

    Why one block: the prefill allocates each layer's permanent tensors between its transients (the group's
    uncompressed keys, the chunk's activations). Per-layer allocations of a few MiB land inside glibc's heap
    among the freed transients, which then cannot be returned, and the process keeps more memory than it holds
    (docs/design.md §4b); a block of every layer's is one large allocation apart from the heap (on a GPU, one
    segment of the caching allocator). A layer whose shape or dtype differs from its block's (no model here has
    one) gets a tensor of its own."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.blocks: dict[str, torch.Tensor] = {}

    def view(self, kind: str, layer: int, shape: tuple[int, ...], like: torch.Tensor,
             fill: float | None = None) -> torch.Tensor:
        """Layer `layer`'s tensor of `kind`, shaped `shape` with `like`'s dtype and device (`fill`: its initial
        value, None: uninitialised, every entry is written before it is read)."""
        block = self.blocks.get(kind)
        if block is None:
            block = like.new_empty((self.num_layers, *shape))
            self.blocks[kind] = block
            if fill is not None:
                block.fill_(fill)
        if block.shape[1:] == shape and block.dtype == like.dtype and block.device == like.device:
            return block[layer]
        own = like.new_empty(shape)
        return own if fill is None else own.fill_(fill)


class EvictingCache(Cache):
    def __init__(self, state: RolloutState):
        self.store = BatchStore(state.num_layers)
        super().__init__(layers=[EvictingLayer(state, i, self.store) for i in range(state.num_layers)])
        self.state = state

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def release(self) -> None:
        """Drop the cache's tensors (keys, values, slots with their per-slot policy state, the buffered window
        queries) once the batch has decoded; what the shadow masks are made of (`state.evict_at`) stays."""
        for layer in self.layers:
            layer.keys = layer.values = layer.prompt_keys = layer.prompt_values = None
        self.store.blocks.clear()
        st = self.state
        st.slots = [None] * st.num_layers
        st.window_queries = [None] * st.num_layers


def _attend_grouped(query, key, value, mask, scaling, num_kv_heads, sum_queries: bool = False):
    """One explicit softmax pass: the attention output and the probabilities summed per GQA group.

    Keys, values and the mask are shared by a group's query heads through views (no per-head copies).
    query [B, Hq, Q, D], key/value [B, H, S, D] (value may be None), mask bool [B, 1, H or Hq, Q, S] ->
    (output [B, Hq, Q, D] or None, probabilities summed over the group [B, H, Q, S] float32, or also
    over the queries [B, H, 1, S] with `sum_queries`). Policies that score keys by attention get it from
    the pass that produces the output instead of a second QK^T beside a fused SDPA kernel (which cannot
    return probabilities).
    """
    B, Hq, Q, D = query.shape
    H, S = num_kv_heads, key.shape[-2]
    groups = Hq // H
    scores = torch.matmul(query.reshape(B, H, groups * Q, D), key.transpose(-1, -2)).float().mul_(scaling)
    # [B, 1 or H, 1, Q, S] broadcasts over the group's query heads; [B, Hq, Q, S] is split per group.
    hidden = ~(mask.reshape(B, H, groups, Q, S) if mask.shape[1] == Hq and groups > 1 else mask.unsqueeze(2))
    scores.view(B, H, groups, Q, S).masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [B, H, groups*Q, S]
    out = None
    if value is not None:
        out = torch.matmul(probs.to(value.dtype), value).view(B, Hq, Q, value.shape[-1])
    if sum_queries:
        return out, probs.sum(dim=2, keepdim=True)
    return out, probs.view(B, H, groups, Q, S).sum(dim=2)


def rollout_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`smd_rollout` attention: masked attention over the evicting cache, then score and evict."""
    st: RolloutState = kwargs["smd_rollout_state"]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if st.phase == "prefill":
        out = prefill_attention(st, module.layer_idx, query, key, value, scaling, kwargs["smd_rollout_cache"])
    else:
        out = decode_attention(st, module.layer_idx, query, key, value, scaling, kwargs["smd_rollout_cache"])
    return out.transpose(1, 2).contiguous(), None


def prefill_attention(st: RolloutState, layer: int, query, key, value, scaling: float, cache: EvictingCache):
    """Dense attention over the prompt; then the policy scores the prompt keys, the budget evicts, and the kept
    keys move into the layer's slots. Returns the attention output [B, Hq, P, D] (or [U, ...]: the distinct
    prompts, when shared).

    Shared prompts (`st.prefill_rows`, docs/design.md §3c): a prompt's keys, values and attention are the same for
    every sample of its group. A policy whose prefill selection depends on the prompt alone selects once per
    distinct prompt; the prompt's kept slots are stored once and each row starts with them all visible (its own
    copy of the slot positions and the policy's per-slot state). Random eviction draws per row: the whole prompt is
    stored once and each row's selection is its visibility over it. Where storing once would not save bytes
    (`shared_slot_counts`), each row stores its own copy of the kept slots, as without sharing."""
    if st.prefill_chunk is not None:
        return _prefill_chunk(st, layer, query, key, value, scaling, cache)
    out, attn_obs = _prefill_output(st, query, key, value, scaling)
    _select_and_store(st, layer, attn_obs, key.shape[1], key.shape[2], cache.layers[layer])
    return out


def _prefill_chunk(st: RolloutState, layer: int, query, key, value, scaling: float, cache: EvictingCache):
    """One chunk of a layer-by-layer prefill (`layerwise_prefill`): the output of its queries (rows r0..r1,
    positions q0..q1) over their rows' keys 0..q1, and what the policy observes of it; after the row group's last
    chunk in this layer, the policy's selection over the group's whole prompts, as `_prefill_output` and
    `_select_and_store` do in one pass. SnapKV's window queries are kept until then (the window attends to every
    prompt key); H2O's column sums accumulate chunk by chunk (a key's sum gathers every later query)."""
    r0, r1, q0, q1 = st.prefill_chunk
    g0, g1 = st.prefill_group
    P, H = st.seq_length, key.shape[1]
    need = st.policy.needs_attention
    end = P - min(st.policy.window_tail, P)  # SnapKV's window ends here (window_anchor)
    w = min(st.eviction["window"], end)
    if r0 == g0 and q0 == 0:  # the group's first chunk in this layer
        if need == "all":
            st.prefill_obs = query.new_zeros(g1 - g0, H, 1, P, dtype=torch.float32)
        elif need == "window":
            st.prefill_obs = query.new_zeros(g1 - g0, query.shape[1], w, query.shape[-1])
    if need == "all":
        out = _explicit_prefill(st, query, key, value, scaling, q0, slice(r0, r1), st.prefill_obs[r0 - g0:r1 - g0])
    elif q0 == 0 and not st.padded:  # queries and keys both start at 0: SDPA's causal kernel
        out = sdpa_gqa(query, key, value, scaling, causal=True)
    else:
        out = sdpa_gqa(query, key, value, scaling, mask=st.prefill_mask(q0, q1, q1, slice(r0, r1)))
    if need == "window" and max(q0, end - w) < min(q1, end):
        a, b = max(q0, end - w), min(q1, end)
        st.prefill_obs[r0 - g0:r1 - g0, :, a - (end - w): b - (end - w)] = query[:, :, a - q0: b - q0]
    if r1 == g1 and q1 == P:  # the group's last chunk in this layer: select over its whole prompts
        keys, values = cache.layers[layer].pending
        attn_obs = st.prefill_obs
        if need == "window":
            attn_obs = _attend_grouped(st.prefill_obs, keys, None, st.prefill_mask(end - w, end, P, slice(g0, g1)),
                                       scaling, H)[1]
        st.prefill_obs = None
        _select_and_store(st, layer, attn_obs, H, P, cache.layers[layer])
    return out


def _select_and_store(st: RolloutState, layer: int, attn_obs: torch.Tensor | None, H: int, P: int,
                      layer_cache: EvictingLayer) -> None:
    """The policy's prefill selection over the layer's prompt keys (`layer_cache.pending`), and the kept keys into
    the layer's slots (or, shared, stored once per distinct prompt).

    `st.prefill_group` set (a row group of `layerwise_prefill`): the pending keys and `attn_obs` are the group's
    prefill rows, and only the batch rows taking their prompt from the group (`st.prefill_group_rows`) are
    written; the first group allocates every row's slots. Each row's selection depends on its own prompt only,
    so the groups' results are the whole batch's."""
    rows = st.prefill_rows
    dest = None if st.prefill_group is None else st.prefill_group_rows  # the batch rows written (None: all)
    local = None if rows is None else _local_prompts(st, rows, dest)  # each written row's prompt in the group

    def of_dest(t: torch.Tensor) -> torch.Tensor:
        return t if dest is None else t.index_select(0, dest)

    if rows is None or st.policy.prefill_per_row:  # a selection per batch row
        if rows is not None and attn_obs is not None:  # the group's distinct prompts' attention, per row
            attn_obs = attn_obs.index_select(0, local)
        evict_at = of_dest(st.evict_at[layer])  # a view of every row's entries when dest is None
        slots = _select_prompt_slots(st, layer, _prompt_slots(of_dest(st.prompt_pad), H, P), attn_obs,
                                     of_dest(st.step_keep), of_dest(st.step_window), of_dest(st.prompt_lens),
                                     evict_at, dest)
        written = None if dest is None else evict_at
        if rows is not None and st.shares_storage:  # slot s is prompt position s (left-padded), stored whole
            _put_rows(st, layer, layer_cache.store, with_own_slots(slots, st.decode_slots), dest, written)
            layer_cache.store_prompts(None, st.prefill_group)
            return
        slots, order = _front_slots(slots, st.capacity)
        _put_rows(st, layer, layer_cache.store, slots, dest, written)
        layer_cache.finish_prefill(order, local, dest)
        return
    # One selection per distinct prompt (of the group), copied to its rows.
    g0, g1 = st.prefill_group or (0, len(st.prefill_first))
    first = st.prefill_first[g0:g1]
    evict_at = st.evict_at.new_full((len(first), *st.evict_at.shape[2:]), -1)
    slots = _select_prompt_slots(st, layer, _prompt_slots(st.prefill_pad[g0:g1], H, P), attn_obs,
                                 st.step_keep.index_select(0, first), st.step_window.index_select(0, first),
                                 st.prompt_lens.index_select(0, first), evict_at)
    if st.shares_storage:
        slots, order = _front_slots(slots, st.prompt_slots)
        _put_rows(st, layer, layer_cache.store, with_own_slots(rows_of(slots, local), st.decode_slots), dest,
                  evict_at.index_select(0, local))
        layer_cache.store_prompts(order, st.prefill_group)
    else:
        slots, order = _front_slots(slots, st.capacity)
        _put_rows(st, layer, layer_cache.store, rows_of(slots, local), dest, evict_at.index_select(0, local))
        layer_cache.finish_prefill(order, local, dest)


def _local_prompts(st: RolloutState, rows: torch.Tensor, dest: torch.Tensor | None) -> torch.Tensor:
    """Shared prompts: the distinct prompt each written batch row takes, counted from the row group's first."""
    if dest is None:
        return rows
    return rows.index_select(0, dest) - st.prefill_group[0]


def _put_rows(st: RolloutState, layer: int, store: BatchStore, slots: LayerSlots, dest: torch.Tensor | None,
              evict_at: torch.Tensor | None) -> None:
    """The layer's slots (and `evict_at` entries, None: already written in place) of batch rows `dest` (None:
    every row, `slots` is the layer's); the slot positions go into the batch's store."""
    if dest is None:
        pos = store.view("slot_pos", layer, tuple(slots.slot_pos.shape), slots.slot_pos)
        st.slots[layer] = LayerSlots(slot_pos=pos.copy_(slots.slot_pos), extra=slots.extra)
        if evict_at is not None:
            st.evict_at[layer].copy_(evict_at)  # before prefill every entry is -1
        return
    if st.prefill_group[0] == 0:  # the first row group: every row's slots, filled group by group
        B = len(st.prompt_lens_host)
        st.slots[layer] = LayerSlots(
            slot_pos=store.view("slot_pos", layer, (B, *slots.slot_pos.shape[1:]), slots.slot_pos, fill=-1),
            extra={name: t.new_zeros((B, *t.shape[1:])) for name, t in slots.extra.items()})
    whole = st.slots[layer]
    whole.slot_pos.index_copy_(0, dest, slots.slot_pos)
    for name, t in slots.extra.items():
        whole.extra[name].index_copy_(0, dest, t)
    st.evict_at[layer].index_copy_(0, dest, evict_at)


def _select_prompt_slots(st: RolloutState, layer: int, slots: LayerSlots, attn_obs: torch.Tensor | None,
                         keep: torch.Tensor, window: torch.Tensor, prompt_lens: torch.Tensor,
                         evict_at: torch.Tensor, batch_rows: torch.Tensor | None = None) -> LayerSlots:
    """The policy's prefill selection over `slots` (one per prompt position): observe the prompt's attention,
    then evict down to `keep`, recording into `evict_at` [rows, H, T]. Rows are the batch's (`batch_rows` of them
    for a row group, None: all) or the distinct prompts'; every argument has the same rows."""
    st.policy.observe_prefill(layer, slots, attn_obs, batch_rows)
    if st.policy.evicts:
        evict(slots, st.policy.scores(layer, slots), keep, prompt_lens - 1, st.eviction["sinks"], window, evict_at)
    return slots


def with_own_slots(slots: LayerSlots, own: int) -> LayerSlots:
    """A row's slots over its shared prompt followed by `own` empty slots of its own (position -1, per-slot state
    0): the layout `decode_attention` reads with shared prompts."""
    pos = slots.slot_pos
    empty = pos.new_full((*pos.shape[:2], own), -1)
    extra = {name: torch.cat([t, t.new_zeros(*t.shape[:2], own, *t.shape[3:])], dim=2)
             for name, t in slots.extra.items()}
    return LayerSlots(slot_pos=torch.cat([pos, empty], dim=-1), extra=extra)


def rows_of(slots: LayerSlots, rows: torch.Tensor) -> LayerSlots:
    """The slots of each batch row from those of its distinct prompt (`rows` [B] indexes the first axis): copies,
    since every row then decodes and evicts on its own."""
    return LayerSlots(slot_pos=slots.slot_pos.index_select(0, rows),
                      extra={name: t.index_select(0, rows) for name, t in slots.extra.items()})


def _prefill_output(st: RolloutState, query, key, value, scaling: float):
    """The prompt's attention output, and the attention the policy observes (None, last-window or all queries)."""
    B, H, P, _ = key.shape
    need = st.policy.needs_attention
    if need == "all":
        attn_obs = query.new_zeros(B, H, 1, P, dtype=torch.float32)
        return _explicit_prefill(st, query, key, value, scaling, 0, slice(None), attn_obs), attn_obs
    if st.padded:
        out = sdpa_gqa(query, key, value, scaling, mask=st.prefill_mask(0, P, P))
    else:  # no mask: SDPA may take its fused (flash / memory-efficient) kernels, as transformers' sdpa does
        out = sdpa_gqa(query, key, value, scaling, causal=True)
    if need == "window":  # the window's queries end `window_tail` tokens before the prompt's end (window_anchor)
        end = P - min(st.policy.window_tail, P)
        w = min(st.eviction["window"], end)
        return out, _attend_grouped(query[:, :, end - w: end], key, None, st.prefill_mask(end - w, end, P),
                                    scaling, H)[1]
    return out, None


def _explicit_prefill(st: RolloutState, query, key, value, scaling: float, q0: int, rows: slice,
                      obs: torch.Tensor) -> torch.Tensor:
    """The output of prompt queries q0.. (of the prefill's rows `rows`) from one explicit softmax pass per
    `_PREFILL_CHUNK` queries (bounding memory), each over the keys up to its end (causal: later keys get no
    attention); adds the attention each key got, summed over the queries and each GQA group, into `obs`
    [rows, H, 1, P] float32 (H2O's column sums)."""
    out = torch.empty_like(query)
    q1 = q0 + query.shape[2]
    for start in range(q0, q1, _PREFILL_CHUNK):
        stop = min(start + _PREFILL_CHUNK, q1)
        part_out, part = _attend_grouped(query[:, :, start - q0: stop - q0], key[:, :, :stop], value[:, :, :stop],
                                         st.prefill_mask(start, stop, stop, rows), scaling, key.shape[1],
                                         sum_queries=True)
        out[:, :, start - q0: stop - q0] = part_out
        obs[..., :stop] += part
    return out


def _prompt_slots(prompt_pad: torch.Tensor, num_kv_heads: int, P: int) -> LayerSlots:
    """One slot per prompt position of the left-padded batch (-1 for padding), for every KV head."""
    pos = torch.arange(P, device=prompt_pad.device).unsqueeze(0) - prompt_pad.unsqueeze(1)  # [B, P]
    slot_pos = pos.masked_fill(pos < 0, -1).unsqueeze(1).expand(len(prompt_pad), num_kv_heads, P).clone()
    return LayerSlots(slot_pos=slot_pos)


def _front_slots(slots: LayerSlots, capacity: int) -> tuple[LayerSlots, torch.Tensor]:
    """Move valid slots to the front and keep the first `capacity` (padding with empty slots when the prompt is
    shorter); returns the new slots and the prompt index each slot takes its key from [B, H, capacity]."""
    valid = slots.slot_pos >= 0
    order = torch.argsort(valid.to(torch.int8), dim=-1, descending=True, stable=True)[..., :capacity]
    fill = None
    if order.shape[-1] < capacity:  # capacity larger than the prompt: pad with empty slots
        extra = capacity - order.shape[-1]
        order = torch.cat([order, order[..., :1].expand(-1, -1, extra)], dim=-1)
        fill = torch.zeros(order.shape, dtype=torch.bool, device=order.device)
        fill[..., -extra:] = True
    new_pos = torch.gather(slots.slot_pos, -1, order)
    if fill is not None:
        new_pos = new_pos.masked_fill(fill, -1)
    extras = {}
    for name, t in slots.extra.items():
        idx = order.view(*order.shape, *([1] * (t.dim() - 3))).expand(*order.shape, *t.shape[3:])
        g = torch.gather(t, 2, idx)
        if fill is not None:
            g[fill] = 0
        extras[name] = g
    return LayerSlots(slot_pos=new_pos, extra=extras), order


def sdpa_layout(query: torch.Tensor, key: torch.Tensor, masked: bool, fused: bool | None = None) -> str:
    """How `sdpa_gqa` hands grouped-query attention to SDPA.

    "gqa": SDPA's `enable_gqa` (the CPU's prefill, or no GQA; on CUDA also an unmasked half-precision call, which
    flash takes). Decoding with GQA and a mask is "grouped" on every device (see below). On CUDA only flash and
    math support `enable_gqa`, and flash takes no explicit mask and no float32 (PyTorch's sdp_utils), so a masked
    or float32 call would fall to the math kernel. Instead, on CUDA
    (`fused` None: the query's device decides):
    "grouped": one query per sequence (decoding): a KV head's group of query heads become its queries
        (query [B, Hq, 1, D] -> [B, H, groups, D]), the mask [B, H, 1, C] broadcast over them: plain attention
        the memory-efficient kernel takes with its mask, without a copy of the cache;
    "expand": several queries (prefill): the KV heads repeated to the query heads (`repeat_kv`, as transformers'
        sdpa attention does), then plain attention with the mask or `is_causal`.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and masked and query.shape[2] == 1:
        # Decoding, on every device: each KV head's keys and values are read once for its group's query heads
        # (SDPA's `enable_gqa` reads them once per query head; on the CPU the grouped call measured 1.25-1.35x
        # faster at 2k-4k slots, 8 x 9 query heads over 3 KV heads, one thread).
        return "grouped"
    fused = query.device.type == "cuda" if fused is None else fused
    if groups == 1 or not fused or (not masked and query.dtype in (torch.float16, torch.bfloat16)):
        return "gqa"
    return "expand"


def sdpa_gqa(query, key, value, scaling: float, mask: torch.Tensor | None = None, causal: bool = False,
             layout: str | None = None) -> torch.Tensor:
    """SDPA of query [B, Hq, Q, D] over GQA keys / values [B, H, S, D] with a boolean `mask` (broadcastable to
    [B, H or 1, Q, S]; True = attend) or `causal`, laid out for a fused kernel (`sdpa_layout`; `layout` forces
    one, e.g. to test every layout on the CPU). Returns [B, Hq, Q, D]; every layout computes the same
    attention (tests/test_gpu_path.py pins them to "gqa")."""
    groups = query.shape[1] // key.shape[1]
    layout = layout or sdpa_layout(query, key, mask is not None)
    if layout == "gqa":
        if mask is not None and mask.shape[1] > 1 and groups > 1:
            mask = mask.repeat_interleave(groups, dim=1)  # per KV head -> per query head
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scaling,
                                              enable_gqa=groups > 1)
    if layout == "grouped":
        B, Hq, Q, D = query.shape
        H = key.shape[1]
        assert Q == 1 and not causal, "the grouped layout is for one query per sequence"
        out = F.scaled_dot_product_attention(query.reshape(B, H, groups, D), key, value, attn_mask=mask,
                                             scale=scaling)
        return out.reshape(B, Hq, 1, value.shape[-1])
    if layout == "expand":
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        if mask is not None and mask.shape[1] > 1:
            mask = mask.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scaling)
    raise ValueError(f"unknown SDPA layout {layout!r}")


def decode_attention(st: RolloutState, layer: int, query, key, value, scaling: float, cache: EvictingCache):
    """One query per sequence over the layer's slots (the new key already inserted); then, at a step that evicts,
    evict down to the step's keep count. Returns the attention output [B, Hq, 1, D]."""
    slots = st.slots[layer]
    H = key.shape[1]
    valid = (slots.slot_pos >= 0).unsqueeze(2)  # [B, H, 1, C]
    observe = st.decode_observation
    lay = cache.layers[layer]
    if st.shares_storage:
        out, probs = attend_shared_prompt(query, lay.prompt_keys, lay.prompt_values, key, value, valid, scaling,
                                          st.group_rows, st.group_index)
        if observe == "every_step":
            st.policy.observe_decode(layer, slots, probs)
    elif observe == "every_step":
        out, probs = _attend_grouped(query, key, value, valid, scaling, H)
        st.policy.observe_decode(layer, slots, probs)
    else:
        out = sdpa_gqa(query, key, value, scaling, mask=valid)
    if observe == "window_queries":
        if st.window_queries[layer] is None:
            B, Hq, _, D = query.shape
            st.window_queries[layer] = query.new_zeros(B, Hq, st.window_pos.shape[1], D)
        st.window_queries[layer].index_copy_(2, st.window_entry, query)
    if st.step_excess > 0:
        if observe == "window_queries":
            st.policy.observe_window(layer, slots, window_attention(st, layer, lay, key, scaling))
        sc = st.policy.scores(layer, slots)
        evict(slots, sc, st.step_keep, st.current_pos, st.eviction["sinks"], st.step_window,
              st.evict_at[layer], at_most_one=st.step_excess <= 1)
    return out


def window_attention(st: RolloutState, layer: int, lay: EvictingLayer, keys: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """The attention the layer's last `window` queries pay to each of its slots, recomputed over the cache as it is
    now, each query over the keys cached before it (slot position <= its own; none before the first decoded query
    fills its entry): [B, H, C] float32, summed over the queries and each GQA group. With shared prompts the
    prompt's slots come first, as in `attend_shared_prompt`."""
    slots = st.slots[layer]
    q = st.window_queries[layer]  # [B, Hq, w, D]
    B, Hq, w, D = q.shape
    H = keys.shape[1]
    g = Hq // H
    qg = q.reshape(B, H, g * w, D)  # a KV head's query heads, each with its w queries
    own = torch.matmul(qg, keys.transpose(-1, -2))
    if st.shares_storage:
        prompt = _from_groups(torch.matmul(_to_groups(qg, st.group_rows), lay.prompt_keys.transpose(-1, -2)),
                              st.group_index, g * w)
        own = torch.cat([prompt, own], dim=-1)
    scores = own.float().mul_(scaling).view(B, H, g, w, -1)
    pos = slots.slot_pos.unsqueeze(2)  # [B, H, 1, C]
    seen = (pos >= 0) & (pos <= st.window_pos.view(B, 1, w, 1))  # [B, H, w, C]
    scores.masked_fill_(~seen.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # an entry not filled yet sees nothing: no weight
    return probs.sum(dim=(2, 3))


def _to_groups(x: torch.Tensor, group_rows: torch.Tensor) -> torch.Tensor:
    """Rows [B, H, g, X] -> each distinct prompt's rows as queries [U, H, n * g, X] (`group_rows` [U, n])."""
    U, n = group_rows.shape
    _, H, g, X = x.shape
    return x.index_select(0, group_rows.reshape(-1)).view(U, n, H, g, X).transpose(1, 2).reshape(U, H, n * g, X)


def _from_groups(x: torch.Tensor, group_index: torch.Tensor, g: int) -> torch.Tensor:
    """The inverse of `_to_groups`: [U, H, n * g, X] -> rows [B, H, g, X] (`group_index` [B] into U x n)."""
    U, H, ng, X = x.shape
    return x.view(U, H, ng // g, g, X).transpose(1, 2).reshape(U * (ng // g), H, g, X).index_select(0, group_index)


def attend_shared_prompt(query, prompt_keys, prompt_values, keys, values, mask, scaling: float,
                         group_rows: torch.Tensor, group_index: torch.Tensor):
    """One decoding query per row over two key sets: its distinct prompt's slots, stored once per group
    ([U, H, Cp, D]), and its own slots ([B, H, Cd, D]); `mask` [B, H, 1, Cp + Cd] is the row's visibility
    (a prompt slot the row evicted is hidden from it alone). One softmax over both sets, as over one cache.

    The prompt's scores and output run as one matmul per distinct prompt whose queries are all its rows' query
    heads (`_to_groups`), so the shared keys are read once per group and never copied per row: the decode-time
    counterpart of Prefix Grouper's shared-prefix attention (arXiv 2506.05433) and of the shared prefix blocks
    of vLLM's prefix caching / SGLang's RadixAttention, here with a per-row mask over the shared slots.
    query [B, Hq, 1, D] -> (output [B, Hq, 1, D], probabilities summed per GQA group [B, H, 1, Cp + Cd] float32).
    """
    B, Hq, _, D = query.shape
    H, Cp = keys.shape[1], prompt_keys.shape[2]
    g = Hq // H
    q = query.reshape(B, H, g, D)
    prompt_scores = _from_groups(torch.matmul(_to_groups(q, group_rows), prompt_keys.transpose(-1, -2)),
                                 group_index, g)
    own_scores = torch.matmul(q, keys.transpose(-1, -2))
    scores = torch.cat([prompt_scores, own_scores], dim=-1).float().mul_(scaling)  # [B, H, g, Cp + Cd]
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    p = probs.to(values.dtype)
    prompt_out = _from_groups(torch.matmul(_to_groups(p[..., :Cp], group_rows), prompt_values), group_index, g)
    out = prompt_out + torch.matmul(p[..., Cp:], values)
    return out.reshape(B, Hq, 1, values.shape[-1]), probs.sum(dim=2, keepdim=True)


AttentionInterface.register(ROLLOUT_ATTENTION, rollout_attention)


@dataclass
class SampleResult:
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_len: int
    evict_at: np.ndarray  # [T, L, H] int32, sentinel T = never evicted
    kv_peak_tokens: int
    kv_dense_tokens: int


@dataclass
class BatchStats:
    cache_bytes: int
    dense_cache_bytes: int
    generated_tokens: int


SAMPLERS = ("multinomial", "inverse_cdf")


def inverse_cdf_index(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [B, V] (non-negative, any positive total): the first index whose float64 cumulative
    probability exceeds uniforms[b] (in [0, 1)) x the row's total. A token's interval is its probability to ~1e-16,
    and a zero-probability token is never returned."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1:]
    # u x total < total, also after rounding, so the first index whose cdf exceeds it has a positive probability
    target = torch.minimum(uniforms.to(torch.float64).reshape(-1, 1) * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def sample_inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [B, V] by inverse transform sampling: u ~ U[0, 1) per row (float64, from
    `generator`), then `inverse_cdf_index`.

    The rule of numpy's `Generator.choice` and of FlashInfer's `sampling_from_probs` (a GPU sampler vLLM uses): an
    exact sample of the categorical, drawing B uniforms instead of torch.multinomial's B x V exponentials (its
    exponential race is most of a CPU decoding step's sampling cost at a 49k vocabulary)."""
    u = torch.rand((probs.shape[0],), generator=generator, dtype=torch.float64, device=probs.device)
    return inverse_cdf_index(probs, u)


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
            sampler: str = "multinomial"):
    """Sample from the full softmax at `temperature` (argmax when 0); return tokens and their log-probs under
    that distribution, the one the learner scores (no top-k / top-p truncation: see RolloutParams). `sampler`
    (rollout.sampler): torch.multinomial's exponential race, or `sample_inverse_cdf`; both draw exactly from the
    softmax, from different random streams."""
    logits = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    # [B, V] buffers are a decoding step's largest transients (12.6 MB at batch 64 and a 49k vocabulary): no
    # division at temperature 1 (x / 1 is x), and the probabilities reuse the logits' buffer, which nothing
    # reads after the log-softmax (the caller's next step replaces them).
    logp = torch.log_softmax(logits if temperature == 1 else logits / temperature, dim=-1)
    probs = torch.exp(logp, out=logits)
    if sampler == "inverse_cdf":
        tok = sample_inverse_cdf(probs, generator)
    elif sampler == "multinomial":
        tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
    else:
        raise ValueError(f"sampler {sampler!r}: choose from {', '.join(SAMPLERS)}")
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def stop_check_interval(device: torch.device, requested: int = 0) -> int:
    """Decoding steps between two stop checks (the loop's one host sync): `requested` when set, else 1 on the
    CPU (a sync costs nothing there, an extra step does) and 8 on an accelerator (kernel launches queue
    ahead instead of waiting for the host every token)."""
    if requested > 0:
        return requested
    return 1 if device.type == "cpu" else 8


@torch.no_grad()
def generate_batch(
    model,
    prompts: list[list[int]],
    eviction: EvictionParams,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int = 0,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    stop_check_every: int = 0,
    compile: bool = False,
    share_prompt: bool = True,
    window_tail: int = 0,
    sampler: str = "multinomial",
    prefill_chunk_tokens: int = 0,
) -> tuple[list[SampleResult], BatchStats]:
    """Sample one response per prompt with the evicting cache; return tokens, log-probs and shadow masks.

    Runs on the model's device. `generator` seeds the sampling; a generator on another device than the model's
    is replaced by one on the model's device with the same seed. `stop_check_every`: decoding steps between
    stop checks (0 = `stop_check_interval`'s default); the results do not depend on it. `compile`: run the
    decoding step through `torch.compile` (CUDA graphs on a GPU; see `compiled_decode_step`). `share_prompt`:
    prefill each distinct prompt once (`prefill`; rollout.share_prompt); false runs every row's own prefill,
    the reference. `window_tail`: tokens every prompt ends with after SnapKV's observation window
    (`observation_window_tail`; 0 = the window ends the prompt). `sampler`: rollout.sampler (`_sample`).
    `prefill_chunk_tokens`: rollout.prefill_chunk_tokens (`layerwise_prefill`; 0 = one forward of the model).
    """
    simulated = None
    if not eviction.apply:  # rollout.eviction.apply false: the prefill's decisions, recorded but not applied
        simulated = simulated_prefill_evictions(model, prompts, eviction, max_new_tokens, pad_token_id, share_prompt,
                                                window_tail, prefill_chunk_tokens)
        eviction = eviction.model_copy(update={"policy": "dense", "apply": True})
    state = new_state(model, prompts, eviction, max_new_tokens, window_tail)
    cache = EvictingCache(state)
    kwargs = {"smd_rollout_state": state, "smd_rollout_cache": cache}
    generator = _on_device(generator, state.device)
    with attention_implementation(model, ROLLOUT_ATTENTION):
        logits = prefill(model, prompts, state, cache, pad_token_id, kwargs, share_prompt, prefill_chunk_tokens)
        step = compiled_decode_step(model) if compile else _decode_step
        tokens, logprobs, lengths, stopped = decode(model, logits, state, cache, kwargs, max_new_tokens,
                                                    eos_token_id, pad_token_id, temperature,
                                                    generator, stop_check_interval(state.device, stop_check_every),
                                                    step, sampler)
    if simulated is not None:  # the dense run's tokens and cache, the policy's decisions as the shadow mask
        state.evict_at = simulated
    stats = batch_stats(model, state, cache, max_new_tokens, lengths)
    # The per-sequence masks `sample_results` builds are a copy of evict_at: the cache is freed first, so the two
    # never sit beside it.
    cache.release()
    return sample_results(state, tokens, logprobs, lengths, stopped), stats


def simulated_prefill_evictions(model, prompts: list[list[int]], eviction: EvictionParams, max_new_tokens: int,
                                pad_token_id: int, share_prompt: bool = True, window_tail: int = 0,
                                prefill_chunk_tokens: int = 0) -> torch.Tensor:
    """`rollout.eviction.apply: false`: the evict_at [L, B, H, P + max_new_tokens] the policy records at the prefill
    of these prompts (compress prefill_only: a compressed rollout's only decisions, which depend on the prompts
    alone), from one prefill of the evicting engine whose cache is then dropped; the caller samples densely."""
    if eviction.compress != "prefill_only":
        raise ValueError("rollout.eviction.apply false needs compress prefill_only")
    state = new_state(model, prompts, eviction.model_copy(update={"apply": True}), max_new_tokens, window_tail)
    cache = EvictingCache(state)
    with attention_implementation(model, ROLLOUT_ATTENTION):
        prefill(model, prompts, state, cache, pad_token_id, {"smd_rollout_state": state, "smd_rollout_cache": cache},
                share_prompt, prefill_chunk_tokens)
    return state.evict_at


def _on_device(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """The sampling generator on `device`: a CPU generator (what stages seed per batch) cannot drive sampling
    on a GPU, so it is replaced by a generator there seeded with its initial seed."""
    if generator is None or generator.device.type == device.type:
        return generator
    return torch.Generator(device=device).manual_seed(generator.initial_seed())


def new_state(model, prompts: list[list[int]], eviction: EvictionParams, max_new_tokens: int,
              window_tail: int = 0) -> RolloutState:
    """The per-batch state on the model's device: the policy, the budget schedule (host) with a cache capacity
    that fits the budget at the longest length, and evict_at [L, B, H, P + max_new_tokens] all -1."""
    cfg = model.config
    device = next(model.parameters()).device
    num_layers = cfg.num_hidden_layers
    num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    ev = eviction.model_dump()
    lens = np.array([len(p) for p in prompts], dtype=np.int64)
    T_max = int(lens.max()) + max_new_tokens
    policy = make_policy(eviction, num_layers)
    policy.window_tail = window_tail if eviction.window_anchor == "user_end" else 0
    schedule = budget_schedule(lens, max_new_tokens, ev, policy.evicts,
                               policy.evicts and ev.get("compress", "every_step") == "every_step")
    policy.start_batch(len(prompts), num_kv, int(lens.max()), max_new_tokens, device)
    return RolloutState(
        policy=policy,
        eviction=ev,
        num_layers=num_layers,
        schedule=schedule,
        prompt_lens=torch.from_numpy(lens).to(device),
        prompt_lens_host=lens,
        evict_at=torch.full((num_layers, len(prompts), num_kv, T_max), -1, dtype=torch.int32, device=device),
        slots=[None] * num_layers,
        window_queries=[None] * num_layers,
        decode_evicts=any(x > 0 for x in schedule.step_excess),
    )


def distinct_prompts(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """The batch's distinct prompts: (first [U], the row where each distinct prompt first occurs; rows [B], the
    distinct prompt of each row, an index into `first`). GRPO's batches hold G samples of each prompt
    (`group_jobs`), so U is about B / G. The prefix sharing of vLLM's prefix caching and SGLang's
    RadixAttention, here for whole prompts and exactly: a prompt token's queries are never restricted by the
    shadow mask (docs/design.md §3c)."""
    index: dict[tuple[int, ...], int] = {}
    first: list[int] = []
    rows: list[int] = []
    for b, p in enumerate(prompts):
        key = tuple(p)
        if key not in index:
            index[key] = len(first)
            first.append(b)
        rows.append(index[key])
    return first, rows


def prompt_groups(rows: list[int], num_prompts: int) -> tuple[list[list[int]], list[int]]:
    """The rows of each distinct prompt, padded to the largest group with the group's first row ([U][n]), and
    where each row sits in that table flattened ([B]: u * n + j): the layout `attend_shared_prompt` batches a
    group's queries in."""
    groups: list[list[int]] = [[] for _ in range(num_prompts)]
    index = []
    for b, u in enumerate(rows):
        index.append((u, len(groups[u])))
        groups[u].append(b)
    n = max(map(len, groups))
    return [grp + [grp[0]] * (n - len(grp)) for grp in groups], [u * n + j for u, j in index]


def shared_slot_counts(prompt_len: int, schedule: BudgetSchedule, selects_per_prompt: bool) -> tuple[int, int]:
    """Slots per (layer, KV head) with shared prompts: (stored once per distinct prompt, owned by each row).

    A distinct prompt stores the keys its selection kept (at most the largest prefill keep count) when its rows
    select alike, else (random eviction, or no eviction) the whole padded prompt. A row owns slots for the keys
    it decodes: one per fed token, at most `max_new_tokens - 1`, and never more than the cache's capacity."""
    stored = min(prompt_len, int(schedule.prefill_keep.max())) if selects_per_prompt else prompt_len
    return stored, max(1, min(len(schedule.step_keep), schedule.capacity))


def prefill(model, prompts: list[list[int]], state: RolloutState, cache: EvictingCache, pad_token_id: int,
            kwargs: dict[str, Any], share_prompt: bool = True, prefill_chunk_tokens: int = 0) -> torch.Tensor:
    """Run the left-padded prompts (dense causal attention, then the first eviction); return the logits
    [B, 1, V] of the first response token.

    `share_prompt`: the model's forward runs on the distinct prompts only (`distinct_prompts`); the policy's
    selection, the slots and the first-token logits are then expanded to every row (`prefill_attention`).
    Every row's results are those of its own prefill, up to the float rounding of a batch of another size.
    `prefill_chunk_tokens` > 0: the prefill runs layer by layer in chunks of that many tokens (`layerwise_prefill`)
    where the model's family allows (`supports_layerwise_prefill`), else as one forward."""
    lens = [len(p) for p in prompts]
    P = max(lens)
    device = state.device
    first, rows = distinct_prompts(prompts) if share_prompt else (list(range(len(prompts))), [])
    shared = len(first) < len(prompts)
    run = [prompts[b] for b in first] if shared else prompts
    ids = np.full((len(run), P), pad_token_id, dtype=np.int64)  # built on the host, copied once
    for i, p in enumerate(run):
        ids[i, P - len(p):] = p
    state.padded = min(lens) < P
    state.prompt_pad = P - state.prompt_lens
    if shared:
        state.prefill_first = torch.tensor(first, dtype=torch.long, device=device)
        state.prefill_rows = torch.tensor(rows, dtype=torch.long, device=device)
        state.prefill_pad = state.prompt_pad.index_select(0, state.prefill_first)
        group_rows, group_index = prompt_groups(rows, len(first))
        state.group_rows = torch.tensor(group_rows, dtype=torch.long, device=device)
        state.group_index = torch.tensor(group_index, dtype=torch.long, device=device)
        stored, own = shared_slot_counts(P, state.schedule, state.policy.evicts and not state.policy.prefill_per_row)
        if len(first) * stored + len(prompts) * own < len(prompts) * state.capacity:  # else each row its own copy
            state.prompt_slots, state.decode_slots = stored, own
    else:
        state.prefill_pad = state.prompt_pad
    state.seq_length = P
    state.step_keep = torch.from_numpy(state.schedule.prefill_keep).to(device)
    state.step_window = state.policy.recent_window(state.step_keep)
    pos = torch.arange(P, device=device).unsqueeze(0) - state.prefill_pad.unsqueeze(1)
    input_ids = torch.from_numpy(ids).to(device)
    if prefill_chunk_tokens > 0 and supports_layerwise_prefill(model):
        logits = layerwise_prefill(model, input_ids, pos.clamp(min=0), state, cache, kwargs, prefill_chunk_tokens)
    else:
        logits = model(input_ids=input_ids, position_ids=pos.clamp(min=0), past_key_values=cache, use_cache=True,
                       logits_to_keep=1, **kwargs).logits
    state.phase = "decode"
    return logits.index_select(0, state.prefill_rows) if shared else logits


# Decoder-only families whose forward is embed -> rotary -> layers -> norm -> lm_head with nothing between (no
# embedding scale, no logit soft-capping): `layerwise_prefill` runs their layers itself.
LAYERWISE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def supports_layerwise_prefill(model) -> bool:
    """Whether `layerwise_prefill` can run this model's layers (else the prefill is one forward of the model)."""
    base = getattr(model, "model", None)
    return (getattr(model.config, "model_type", None) in LAYERWISE_MODEL_TYPES and hasattr(model, "lm_head")
            and all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")))


def prefill_chunks(rows: int, length: int, chunk_tokens: int) -> list[tuple[int, int, int, int]]:
    """A layer's prefill work in chunks of at most `chunk_tokens` query tokens (or one row's whole prompt when a
    token is all it takes): (first row, end row, first query, end query). Prompts shorter than the budget go
    several rows at a time; a longer prompt goes one row at a time, in query chunks, each over its row's keys so
    far (vLLM's chunked prefill, `max_num_batched_tokens`)."""
    if length >= chunk_tokens:
        return [(r, r + 1, q, min(q + chunk_tokens, length)) for r in range(rows)
                for q in range(0, length, chunk_tokens)]
    per = max(1, chunk_tokens // max(length, 1))
    return [(r, min(r + per, rows), 0, length) for r in range(0, rows, per)]


def layerwise_prefill(model, input_ids: torch.Tensor, position_ids: torch.Tensor, state: RolloutState,
                      cache: EvictingCache, kwargs: dict[str, Any], chunk_tokens: int) -> torch.Tensor:
    """The prefill row group by row group, each group through every layer in chunks of at most `chunk_tokens`
    query tokens (`prefill_chunks`: several short prompts at once, or one long prompt in query chunks), each
    layer's keys compressed right after the group's last chunk in it: returns the logits [rows, 1, V] of the
    first response token.

    What the prefill holds beyond the compressed cache is one group's hidden states and rotary tables, one layer's
    uncompressed keys and values of the group, and one chunk's activations (attention and the MLP's
    intermediate): bounded by the chunk, not by the batch's prompt tokens (vLLM's chunked prefill runs each
    chunk through every layer the same way). SnapKV's observation window still attends to the whole prompt and
    H2O's column sums still gather every query (`_prefill_chunk`). The same layers, positions and masks as the
    model's forward: equal to it up to float rounding (tests/test_long_context_rollout.py)."""
    base = model.model
    rows, P = input_ids.shape
    plan = prefill_chunks(rows, P, chunk_tokens)
    groups = sorted({(r0, r1) for r0, r1, _, _ in plan})
    logits = []
    for g0, g1 in groups:
        state.prefill_group = (g0, g1)
        if state.prefill_rows is None:
            state.prefill_group_rows = torch.arange(g0, g1, device=state.device)
        else:  # the batch rows whose distinct prompt is in the group
            taken = state.prefill_rows
            state.prefill_group_rows = ((taken >= g0) & (taken < g1)).nonzero().squeeze(1)
        chunks = [(r0, r1, q0, q1) for r0, r1, q0, q1 in plan if (r0, r1) == (g0, g1)]
        hidden = base.embed_tokens(input_ids[g0:g1])
        cos, sin = base.rotary_emb(hidden, position_ids=position_ids[g0:g1])
        for layer in base.layers[: model.config.num_hidden_layers]:
            for r0, r1, q0, q1 in chunks:
                state.prefill_chunk = (r0, r1, q0, q1)
                part = slice(r0 - g0, r1 - g0)
                hidden[part, q0:q1] = layer(hidden[part, q0:q1], attention_mask=None,
                                            position_ids=position_ids[r0:r1, q0:q1], past_key_values=cache,
                                            use_cache=True, position_embeddings=(cos[part, q0:q1], sin[part, q0:q1]),
                                            **kwargs)
        logits.append(model.lm_head(base.norm(hidden[:, -1:])))
        del hidden, cos, sin
    state.prefill_chunk = state.prefill_group = state.prefill_group_rows = None
    return torch.cat(logits)


def _decode_step(model, feed: torch.Tensor, position_ids: torch.Tensor, cache: EvictingCache,
                 kwargs: dict[str, Any]) -> torch.Tensor:
    """One decoding forward: the token of every sequence at its position -> next-token logits [B, 1, V]."""
    return model(input_ids=feed, position_ids=position_ids, past_key_values=cache, use_cache=True, **kwargs).logits


_COMPILED_STEPS: dict[int, Any] = {}


def compiled_decode_step(model):
    """`_decode_step` through `torch.compile` (one compiled function per model object, reused across batches).

    The step's shapes are static within a batch (the slot cache has a fixed capacity), so after a warm-up the
    same graph runs every step: on a GPU, with `mode="reduce-overhead"`, as CUDA graphs. What varies per step
    (positions, keep counts) enters as tensors; whether a step evicts (the schedule's excess, 0 or 1) selects
    one of two graphs. Between batches the capacity and the batch size may change: torch.compile's automatic
    dynamic shapes then compile one graph with those sizes symbolic instead of one per batch.
    """
    key_compile_caches_to_cpu_isa()  # a CPU kernel cached under another vector ISA must not be read back
    key = id(model)
    if key not in _COMPILED_STEPS:
        device = next(model.parameters()).device
        mode = "reduce-overhead" if device.type == "cuda" else None
        _COMPILED_STEPS[key] = torch.compile(_decode_step, mode=mode)
    return _COMPILED_STEPS[key]


def decode(model, logits: torch.Tensor, state: RolloutState, cache: EvictingCache, kwargs: dict[str, Any],
           max_new_tokens: int, eos_token_id: int | None, pad_token_id: int, temperature: float,
           generator: torch.Generator | None, stop_check_every: int = 1, step_fn=_decode_step,
           sampler: str = "multinomial"):
    """Sample token by token until every sequence stopped or max_new_tokens; each step feeds the sampled token
    at its original position and evicts down to the budget.

    Everything stays on the device: tokens [B, N] and log-probs [B, N] (entries past a sequence's end are
    ignored), response lengths [B] and stop flags [B] ("stop" at EOS, else "length"). The host syncs only
    for the stop check, every `stop_check_every` steps; a step after every sequence stopped feeds padding and
    records nothing, so the results are those of checking every step.
    """
    lens = state.prompt_lens
    B, device = len(lens), state.device
    tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    schedule = state.schedule
    step_keep = torch.from_numpy(schedule.step_keep).to(device)  # [S, B], one copy per batch
    step_window = state.policy.recent_window(step_keep)
    P = state.seq_length
    windowed = state.decode_observation == "window_queries"
    if windowed:
        w = int(state.eviction["window"])
        state.window_pos = torch.full((B, w), -1, dtype=lens.dtype, device=device)
        state.window_entry = torch.zeros((1,), dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        tok, lp = _sample(logits[:, -1], temperature, generator, sampler)
        tokens[:, step] = tok
        logprobs[:, step] = lp
        lengths += alive
        if eos_token_id is not None:
            alive &= tok != eos_token_id
        if step == max_new_tokens - 1 or ((step + 1) % stop_check_every == 0 and not bool(alive.any())):
            break
        state.current_pos = lens + step
        state.seq_length = P + step + 1
        state.step_keep, state.step_window = step_keep[step], step_window[step]
        state.step_excess = schedule.step_excess[step]
        feed = torch.where(alive, tok, torch.full_like(tok, pad_token_id))
        if windowed:
            state.window_pos.index_copy_(1, state.window_entry, state.current_pos[:, None])
        logits = step_fn(model, feed[:, None], state.current_pos[:, None], cache, kwargs)
        if windowed:
            state.window_entry.add_(1).remainder_(state.window_pos.shape[1])
    return tokens, logprobs, lengths, ~alive  # a sequence stops only at EOS


def sample_results(state: RolloutState, tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor,
                   stopped: torch.Tensor) -> list[SampleResult]:
    """Per sequence: the response, and evict_at [T, L, H] of its unpadded row (sentinel T = never evicted).
    The batch's tensors come to the host here, once."""
    results = []
    ev_np = state.evict_at.cpu().numpy()
    tokens_np, logprobs_np = tokens.cpu().numpy(), logprobs.cpu().numpy()
    lengths_np, stopped_np = lengths.cpu().numpy(), stopped.cpu().numpy()
    for i, P_i in enumerate(state.prompt_lens_host.tolist()):
        R_i = int(lengths_np[i])
        T = P_i + R_i
        e = ev_np[:, i, :, :T].transpose(2, 0, 1).astype(np.int64)  # [T, L, H]
        e = np.where((e < 0) | (e > T), T, e).astype(np.int32)
        counts = visible_counts(e)[P_i:] if R_i else np.zeros((1,), dtype=np.int64)
        results.append(
            SampleResult(
                response_ids=tokens_np[i, :R_i].tolist(),
                logprobs=logprobs_np[i, :R_i].tolist(),
                finish_reason="stop" if stopped_np[i] else "length",
                prompt_len=P_i,
                evict_at=e,
                kv_peak_tokens=int(counts.max()),
                kv_dense_tokens=T,
            )
        )
    return results


def batch_stats(model, state: RolloutState, cache: EvictingCache, max_new_tokens: int,
                lengths: torch.Tensor) -> BatchStats:
    """Bytes of the evicting cache against a dense cache of the same batch."""
    cfg = model.config
    num_kv = state.evict_at.shape[2]
    itemsize = next(model.parameters()).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dense_capacity = int(state.prompt_lens_host.max()) + max_new_tokens
    return BatchStats(
        cache_bytes=cache.nbytes(),
        dense_cache_bytes=2 * state.num_layers * len(lengths) * num_kv * dense_capacity * head_dim * itemsize,
        generated_tokens=int(lengths.sum()),
    )
