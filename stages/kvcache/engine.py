"""Batched sampling on Hugging Face transformers with an evicting KV cache and exact shadow-mask recording.

How it plugs into transformers:
- `EvictingCache` is a `transformers.Cache` whose layers keep a fixed number of physical slots per
  (sequence, KV head): the budget at the longest length, never more. Keys are stored after RoPE, so an
  evicted key's neighbours keep their original positions (decoding passes explicit `position_ids`).
- The attention function `smd_rollout` (registered through `AttentionInterface`) masks empty slots,
  computes the attention probabilities a policy asks for, lets the policy score the slots, and evicts
  right after the layer's attention ran: a step's visible set is the cache content when it runs.
- Every eviction writes `evict_at[layer, seq, head, pos] = query_pos + 1` (docs/design.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from schemas.masks import budget, visible_counts
from schemas.params.rollout import EvictionParams
from stages.kvcache.policies import EvictionPolicy, LayerSlots, evict, make_policy
from stages.model import attention_implementation

ROLLOUT_ATTENTION = "smd_rollout"
_PREFILL_CHUNK = 64  # query chunk for attention-probability passes (bounds memory at long prompts)


@dataclass
class RolloutState:
    """Everything the attention function needs to know about the current forward pass."""

    policy: EvictionPolicy
    eviction: dict[str, Any]
    num_layers: int
    capacity: int
    prompt_lens: torch.Tensor  # [B]
    evict_at: torch.Tensor  # [L, B, H, T_max] int32, -1 = never evicted
    phase: str = "prefill"
    prefill_mask: torch.Tensor | None = None  # [B, 1, P, P]
    current_pos: torch.Tensor | None = None  # [B] position of the query being decoded
    slots: list[LayerSlots | None] = field(default_factory=list)
    step_keep: torch.Tensor | None = None  # keep_after() for the current decoding step, computed once
    step_window: torch.Tensor | None = None  # the policy's recent window for step_keep, computed once
    # Most keys any sequence is over its keep count this step (0: no layer evicts; 1 in decoding), decided
    # once per step by generate_batch instead of by a tensor check in every layer.
    step_excess: int = 0

    def keep_after(self, n_seen: torch.Tensor) -> torch.Tensor:
        """Keys that may stay cached so that the next query (n_seen + 1 tokens) sees <= budget."""
        return torch.tensor([budget(int(n) + 1, self.eviction, int(p)) - 1
                             for n, p in zip(n_seen.tolist(), self.prompt_lens.tolist(), strict=True)])

    @property
    def evicts_while_decoding(self) -> bool:
        return self.policy.evicts and self.eviction.get("compress", "every_step") == "every_step"


class EvictingLayer(CacheLayerMixin):
    """One layer's physical cache: keys/values [B, H, capacity, D] plus slot positions."""

    is_compileable = False
    is_sliding = False

    def __init__(self, state: RolloutState, layer_idx: int):
        super().__init__()
        self.state = state
        self.layer_idx = layer_idx
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def lazy_initialization(self, key_states, value_states):
        B, H, _, D = key_states.shape
        C = self.state.capacity
        self.keys = key_states.new_zeros(B, H, C, D)
        self.values = value_states.new_zeros(B, H, C, D)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        st = self.state
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if st.phase == "prefill":
            # Attention runs over the full prompt; the kept keys are copied into the slots afterwards.
            self.pending = (key_states, value_states)
            return key_states, value_states
        slots = st.slots[self.layer_idx]
        free = slots.slot_pos < 0
        slot_idx = free.to(torch.int8).argmax(dim=-1)  # first free slot per (b, h)
        B, H = slot_idx.shape
        b_idx = torch.arange(B).repeat_interleave(H)
        h_idx = torch.arange(H).repeat(B)
        s_idx = slot_idx.reshape(-1)
        self.keys[b_idx, h_idx, s_idx] = key_states[:, :, 0].reshape(B * H, -1)
        self.values[b_idx, h_idx, s_idx] = value_states[:, :, 0].reshape(B * H, -1)
        slots.slot_pos[b_idx, h_idx, s_idx] = st.current_pos[b_idx]
        st.policy.on_insert(self.layer_idx, slots, b_idx, h_idx, s_idx)
        return self.keys, self.values

    def finish_prefill(self, keep_idx: torch.Tensor) -> None:
        """Copy the kept prompt keys (indices into the prompt axis, [B, H, C]) into the slots."""
        k, v = self.pending
        D = k.shape[-1]
        idx = keep_idx.unsqueeze(-1).expand(-1, -1, -1, D)
        self.keys.copy_(torch.gather(k, 2, idx))
        self.values.copy_(torch.gather(v, 2, idx))
        self.pending = None

    def get_seq_length(self) -> int:
        return 0 if self.state.current_pos is None else int(self.state.current_pos.max()) + 1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.capacity, 0

    def get_max_length(self) -> int:
        return self.state.capacity

    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class EvictingCache(Cache):
    def __init__(self, state: RolloutState):
        super().__init__(layers=[EvictingLayer(state, i) for i in range(state.num_layers)])
        self.state = state

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


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
        out = decode_attention(st, module.layer_idx, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def prefill_attention(st: RolloutState, layer: int, query, key, value, scaling: float, cache: EvictingCache):
    """Dense attention over the prompt; then the policy scores the prompt keys, the budget evicts, and the kept
    keys move into the layer's slots. Returns the attention output [B, Hq, P, D]."""
    out, attn_obs = _prefill_output(st, query, key, value, scaling)
    slots = _prompt_slots(st.prompt_lens, key.shape[1], st.prefill_mask.shape[-1])
    st.policy.observe_prefill(layer, slots, attn_obs)
    if st.policy.evicts:
        keep = st.keep_after(st.prompt_lens)
        evict(slots, st.policy.scores(layer, slots), keep, st.prompt_lens - 1, st.eviction["sinks"],
              st.policy.recent_window(keep), st.evict_at[layer])
    st.slots[layer], order = _front_slots(slots, st.capacity)
    cache.layers[layer].finish_prefill(order)
    return out


def _prefill_output(st: RolloutState, query, key, value, scaling: float):
    """The prompt's attention output, and the attention the policy observes (None, last-window or all queries)."""
    mask = st.prefill_mask  # [B, 1, P, P]
    B, _, P, _ = mask.shape
    H = key.shape[1]
    need = st.policy.needs_attention
    if need == "all":
        # Output and column sums from one explicit pass, chunked over queries to bound memory.
        attn_obs = query.new_zeros(B, H, 1, P, dtype=torch.float32)
        out = torch.empty_like(query)
        for start in range(0, P, _PREFILL_CHUNK):
            end = min(start + _PREFILL_CHUNK, P)  # causal: keys beyond the chunk get no attention
            part_out, part = _attend_grouped(query[:, :, start:end], key[:, :, :end], value[:, :, :end],
                                             mask[:, :, start:end, :end], scaling, H, sum_queries=True)
            out[:, :, start:end] = part_out
            attn_obs[..., :end] += part
        return out, attn_obs
    groups = query.shape[1] // H
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
    if need == "window":
        w = min(st.eviction["window"], P)
        return out, _attend_grouped(query[:, :, -w:], key, None, mask[:, :, -w:], scaling, H)[1]
    return out, None


def _prompt_slots(prompt_lens: torch.Tensor, num_kv_heads: int, P: int) -> LayerSlots:
    """One slot per prompt position of the left-padded batch (-1 for padding), for every KV head."""
    pad = P - prompt_lens
    pos = torch.arange(P).unsqueeze(0) - pad.unsqueeze(1)  # [B, P]
    slot_pos = pos.masked_fill(pos < 0, -1).unsqueeze(1).expand(len(prompt_lens), num_kv_heads, P).clone()
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
        fill = torch.zeros(order.shape, dtype=torch.bool)
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


def decode_attention(st: RolloutState, layer: int, query, key, value, scaling: float):
    """One query per sequence over the layer's slots (the new key already inserted); then evict down to the
    step's keep count. Returns the attention output [B, Hq, 1, D]."""
    slots = st.slots[layer]
    H = key.shape[1]
    groups = query.shape[1] // H
    valid = (slots.slot_pos >= 0).unsqueeze(2)  # [B, H, 1, C]
    if st.policy.needs_attention != "none" and st.evicts_while_decoding:
        out, probs = _attend_grouped(query, key, value, valid, scaling, H)
        st.policy.observe_decode(layer, slots, probs)
    else:
        mask = valid.repeat_interleave(groups, dim=1) if groups > 1 else valid  # [B, Hq, 1, C]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=groups > 1)
    if st.step_excess > 0:
        sc = st.policy.scores(layer, slots)
        evict(slots, sc, st.step_keep, st.current_pos, st.eviction["sinks"], st.step_window,
              st.evict_at[layer], at_most_one=st.step_excess <= 1)
    return out


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


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None):
    """Sample (or argmax when temperature == 0); return tokens and their log-probs under the used distribution."""
    logits = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)
    logp = torch.log_softmax(logits, dim=-1)
    tok = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


@torch.no_grad()
def generate_batch(
    model,
    prompts: list[list[int]],
    eviction: EvictionParams,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int = 0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[list[SampleResult], BatchStats]:
    """Sample one response per prompt with the evicting cache; return tokens, log-probs and shadow masks."""
    state = new_state(model, prompts, eviction, max_new_tokens)
    cache = EvictingCache(state)
    kwargs = {"smd_rollout_state": state, "smd_rollout_cache": cache}
    with attention_implementation(model, ROLLOUT_ATTENTION):
        logits = prefill(model, prompts, state, cache, pad_token_id, kwargs)
        responses, logprobs, finish = decode(model, logits, state, cache, kwargs, max_new_tokens, eos_token_id,
                                             pad_token_id, temperature, top_k, top_p, generator)
    return sample_results(state, responses, logprobs, finish), batch_stats(model, state, cache, max_new_tokens,
                                                                           responses)


def new_state(model, prompts: list[list[int]], eviction: EvictionParams, max_new_tokens: int) -> RolloutState:
    """The per-batch state: the policy, a cache capacity that fits the budget at the longest length, and
    evict_at [L, B, H, P + max_new_tokens] all -1 (never evicted)."""
    cfg = model.config
    num_layers = cfg.num_hidden_layers
    num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    ev = eviction.model_dump()
    lens = torch.tensor([len(p) for p in prompts])
    T_max = int(lens.max()) + max_new_tokens
    return RolloutState(
        policy=make_policy(eviction, num_layers),
        eviction=ev,
        num_layers=num_layers,
        capacity=max(budget(int(n) + max_new_tokens, ev, int(n)) for n in lens.tolist()),
        prompt_lens=lens,
        evict_at=torch.full((num_layers, len(prompts), num_kv, T_max), -1, dtype=torch.int32),
        slots=[None] * num_layers,
    )


def prefill(model, prompts: list[list[int]], state: RolloutState, cache: EvictingCache, pad_token_id: int,
            kwargs: dict[str, Any]) -> torch.Tensor:
    """Run the left-padded prompts (dense causal attention, then the first eviction); return the logits
    [B, 1, V] of the first response token."""
    lens = state.prompt_lens
    P = int(lens.max())
    input_ids = torch.full((len(prompts), P), pad_token_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
    pos = torch.arange(P).unsqueeze(0) - (P - lens).unsqueeze(1)
    causal = torch.ones(P, P, dtype=torch.bool).tril()
    mask = causal.unsqueeze(0) & (pos >= 0).unsqueeze(1)
    mask = mask | torch.eye(P, dtype=torch.bool).unsqueeze(0)  # padding queries see themselves (finite softmax)
    state.prefill_mask = mask.unsqueeze(1)
    out = model(input_ids=input_ids, position_ids=pos.clamp(min=0), past_key_values=cache, use_cache=True,
                logits_to_keep=1, **kwargs)
    state.phase = "decode"
    return out.logits


def decode(model, logits: torch.Tensor, state: RolloutState, cache: EvictingCache, kwargs: dict[str, Any],
           max_new_tokens: int, eos_token_id: int | None, pad_token_id: int, temperature: float, top_k: int,
           top_p: float, generator: torch.Generator | None):
    """Sample token by token until every sequence stopped or max_new_tokens; each step feeds the sampled token
    at its original position and evicts down to the budget. Returns per-sequence tokens, log-probs and
    finish reasons ("stop" at EOS, else "length")."""
    lens = state.prompt_lens
    B = len(lens)
    responses: list[list[int]] = [[] for _ in range(B)]
    logprobs: list[list[float]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    finish = ["length"] * B
    # Keys each sequence holds per (layer, KV head): every layer and head inserts one key per step and
    # evicts down to the same keep count, so one number per sequence tracks them all.
    cached = lens.tolist()
    if state.policy.evicts:  # prefill evicted every layer and head down to the same count
        cached = [min(n, k) for n, k in zip(cached, state.keep_after(lens).tolist(), strict=True)]
    for step in range(max_new_tokens):
        tok, lp = _sample(logits[:, -1], temperature, top_k, top_p, generator)
        for i in range(B):
            if not done[i]:
                responses[i].append(int(tok[i]))
                logprobs[i].append(float(lp[i]))
                if eos_token_id is not None and int(tok[i]) == eos_token_id:
                    done[i] = True
                    finish[i] = "stop"
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        state.current_pos = lens + step
        state.step_keep = state.keep_after(state.current_pos + 1)
        state.step_window = state.policy.recent_window(state.step_keep)
        cached = [n + 1 for n in cached]  # this step's key, in every layer and head
        if state.evicts_while_decoding:
            keep = state.step_keep.tolist()
            state.step_excess = max(n - k for n, k in zip(cached, keep, strict=True))
            cached = [min(n, k) for n, k in zip(cached, keep, strict=True)]
        feed = torch.where(done, torch.full_like(tok, pad_token_id), tok)
        logits = model(input_ids=feed[:, None], position_ids=state.current_pos[:, None],
                       past_key_values=cache, use_cache=True, **kwargs).logits
    return responses, logprobs, finish


def sample_results(state: RolloutState, responses: list[list[int]], logprobs: list[list[float]],
                   finish: list[str]) -> list[SampleResult]:
    """Per sequence: the response, and evict_at [T, L, H] of its unpadded row (sentinel T = never evicted)."""
    results = []
    ev_np = state.evict_at.numpy()
    for i, (P_i, response) in enumerate(zip(state.prompt_lens.tolist(), responses, strict=True)):
        R_i = len(response)
        T = P_i + R_i
        e = ev_np[:, i, :, :T].transpose(2, 0, 1).astype(np.int64)  # [T, L, H]
        e = np.where((e < 0) | (e > T), T, e).astype(np.int32)
        counts = visible_counts(e)[P_i:] if R_i else np.zeros((1,), dtype=np.int64)
        results.append(
            SampleResult(
                response_ids=response,
                logprobs=logprobs[i],
                finish_reason=finish[i],
                prompt_len=P_i,
                evict_at=e,
                kv_peak_tokens=int(counts.max()),
                kv_dense_tokens=T,
            )
        )
    return results


def batch_stats(model, state: RolloutState, cache: EvictingCache, max_new_tokens: int,
                responses: list[list[int]]) -> BatchStats:
    """Bytes of the evicting cache against a dense cache of the same batch."""
    cfg = model.config
    num_kv = state.evict_at.shape[2]
    itemsize = next(model.parameters()).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dense_capacity = int(state.prompt_lens.max()) + max_new_tokens
    return BatchStats(
        cache_bytes=cache.nbytes(),
        dense_cache_bytes=2 * state.num_layers * len(responses) * num_kv * dense_capacity * head_dim * itemsize,
        generated_tokens=sum(len(r) for r in responses),
    )
