"""One interface for every KV eviction policy, and a registry (the way kvpress organises its presses).

A policy only *scores* cache slots (and may size its recent window); the shared `evict` below applies the
budget, protects attention sinks and the recent window, breaks ties deterministically and records the
shadow mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from schemas.params.rollout import POLICIES, EvictionParams

POLICY_REGISTRY: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Register a policy class under its name, one of the names `rollout.eviction.policy` accepts."""
    if cls.name not in POLICIES:
        raise ValueError(f"policy {cls.name!r} is not one of the eviction policy names {POLICIES} (schemas.params.rollout)")
    POLICY_REGISTRY[cls.name] = cls
    return cls


def make_policy(cfg: EvictionParams, num_layers: int) -> EvictionPolicy:
    return POLICY_REGISTRY[cfg.policy](cfg, num_layers)


@dataclass
class LayerSlots:
    """Per-layer view handed to a policy: slot positions and the policy's own per-slot tensors."""

    slot_pos: torch.Tensor  # [B, H, S] original token position of each slot, -1 = empty
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per-slot state, last dim(s) start with S


class EvictionPolicy:
    """Base class. Subclasses set `name`, `needs_attention`, and implement `scores`.

    needs_attention: "none" (scores from positions alone), "window" (attention of the last `window`
    prefill queries) or "all" (attention of every query). The engine computes only what is asked.
    prefill_per_row: see below; `observe_prefill` then receives every row, else it may receive one row per
    distinct prompt (the engine copies the selection to the prompt's rows).
    window_tail: prompt tokens after the observation window (SnapKV's `window_anchor: user_end`: the chat
    template's closing tokens); the engine sets it per batch, 0 = the window ends the prompt.
    """

    name: ClassVar[str] = ""
    needs_attention: ClassVar[str] = "none"
    evicts: ClassVar[bool] = True
    # Whether the prefill's selection depends on more than the prompt (random eviction's per-row draws). When
    # false, the samples of one prompt select alike, and a shared prefill selects once per distinct prompt.
    prefill_per_row: ClassVar[bool] = False

    def __init__(self, cfg: EvictionParams, num_layers: int):
        self.cfg = cfg
        self.num_layers = num_layers
        self.window_tail = 0

    # Hooks (no-ops by default) -------------------------------------------------------------
    def start_batch(self, batch: int, num_kv_heads: int, prompt_len: int, max_new_tokens: int,
                    device: torch.device) -> None:
        """A batch of `batch` sequences (left-padded to `prompt_len`) starts on `device`."""

    def observe_prefill(self, layer: int, slots: LayerSlots, attn: torch.Tensor | None,
                        rows: torch.Tensor | None = None) -> None:
        """attn: [B, H_kv, Q, S] attention summed over each GQA group (None if not needed). `rows`: the batch rows
        `slots` hold, in order, when the prefill selects a group of rows at a time (`layerwise_prefill`); None:
        every row of the batch (or, for a policy that is not `prefill_per_row`, every distinct prompt)."""

    def observe_decode(self, layer: int, slots: LayerSlots, attn: torch.Tensor | None) -> None:
        """attn: [B, H_kv, 1, S] for the token just decoded (None if not needed)."""

    def decode_observation(self) -> str:
        """What a decoding step hands this policy: "none" (scores from positions or draws), "every_step" (each
        step's attention, `observe_decode`) or "window_queries" (the engine keeps the last `window` queries and,
        at a step that evicts, hands their attention over the cache to `observe_window`)."""
        return "none" if self.needs_attention == "none" else "every_step"

    def observe_window(self, layer: int, slots: LayerSlots, attn: torch.Tensor) -> None:
        """attn [B, H_kv, S] float: the attention the last `window` decoded queries pay to each slot, summed over
        the queries and each GQA group (`decode_observation` "window_queries")."""
        raise NotImplementedError

    def on_insert(self, layer: int, slots: LayerSlots, batch_idx: torch.Tensor, head_idx: torch.Tensor,
                  slot_idx: torch.Tensor) -> None:
        """A new key was written into (batch, head, slot); reset that slot's per-slot state."""
        for t in slots.extra.values():
            t[batch_idx, head_idx, slot_idx] = 0

    def scores(self, layer: int, slots: LayerSlots) -> torch.Tensor:
        """[B, H, S] float; higher = more worth keeping."""
        raise NotImplementedError

    def recent_window(self, keep: torch.Tensor) -> torch.Tensor:
        """[B] recent window per sequence when each may keep `keep[b]` keys: the window - 1 newest cached
        keys are never evicted (with the next query they form the window it sees). Default `window`."""
        return torch.full_like(keep, self.cfg.window)


def evict(
    slots: LayerSlots,
    scores: torch.Tensor,
    keep: torch.Tensor,
    current_pos: torch.Tensor,
    sinks: int,
    window: int | torch.Tensor,
    evict_at: torch.Tensor,
    at_most_one: bool = False,
) -> torch.Tensor:
    """Evict down to `keep[b]` slots per (b, h), record `evict_at`, return the number of evictions.

    Protected (never evicted): positions < sinks and the window-1 most recent positions (with the next
    token they form the recent window the next query sees); `window` is an int or one per sequence [B]. Among the rest, lowest score goes first;
    ties evict the oldest position. `evict_at[b, h, pos] = current_pos[b] + 1` for every evicted key.

    `at_most_one`: the caller knows no (b, h) holds more than keep + 1 keys (a decoding step: one key in,
    a budget that grows by at most one). The single victim is then found with a min and an argmin
    instead of two sorts; the rule, tie-break included, is the same.
    """
    pos = slots.slot_pos
    valid = pos >= 0
    cur = current_pos.view(-1, 1, 1)
    win = window.view(-1, 1, 1) if isinstance(window, torch.Tensor) else window
    protected = valid & ((pos < sinks) | (pos > cur - (win - 1)))
    if at_most_one:
        return _evict_one(slots, scores, keep, current_pos, valid, protected, evict_at)
    key = scores.to(torch.float64).masked_fill(protected, float("inf")).masked_fill(~valid, float("-inf"))
    # Deterministic tie-break: sort by position (newest first), then stable sort by score (highest first).
    by_pos = torch.argsort(pos, dim=-1, descending=True, stable=True)
    key_sorted = torch.gather(key, -1, by_pos)
    by_score = torch.argsort(key_sorted, dim=-1, descending=True, stable=True)
    order = torch.gather(by_pos, -1, by_score)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    victims = valid & (rank >= keep.view(-1, 1, 1))
    _record_evictions(evict_at, pos, victims, current_pos)
    pos.masked_fill_(victims, -1)
    return victims.sum()


def _record_evictions(evict_at: torch.Tensor, pos: torch.Tensor, victims: torch.Tensor,
                      current_pos: torch.Tensor) -> None:
    """evict_at[b, h, pos[b, h, s]] = current_pos[b] + 1 where victims[b, h, s], without a host sync (no
    nonzero). A key is evicted once, so its entry is still -1: an `amax` scatter that writes -1 for every
    non-victim (empty slots clamped to position 0 included) changes exactly the victims' entries."""
    value = (current_pos.view(-1, 1, 1) + 1).to(evict_at.dtype).expand(pos.shape)
    src = torch.where(victims, value, torch.full_like(value, -1))
    evict_at.scatter_reduce_(-1, pos.clamp(min=0), src, reduce="amax")


def _evict_one(slots: LayerSlots, scores: torch.Tensor, keep: torch.Tensor, current_pos: torch.Tensor,
               valid: torch.Tensor, protected: torch.Tensor, evict_at: torch.Tensor) -> torch.Tensor:
    """`evict` when each (b, h) is at most one key over `keep`: its lowest-scored, oldest unprotected key."""
    pos = slots.slot_pos
    over = valid.sum(-1) > keep.view(-1, 1)  # [B, H]
    key = scores.to(torch.float64).masked_fill(protected | ~valid, float("inf"))
    lowest = key.amin(dim=-1, keepdim=True)
    # Among the valid keys with the lowest score (protected ones only when nothing else is left, as in the
    # sorting rule), the oldest; empty slots never.
    oldest = pos.masked_fill((key != lowest) | ~valid, torch.iinfo(pos.dtype).max).argmin(dim=-1)  # [B, H]
    victim = torch.zeros_like(valid).scatter_(-1, oldest.unsqueeze(-1), over.unsqueeze(-1))  # [B, H, S]
    _record_evictions(evict_at, pos, victim, current_pos)
    pos.masked_fill_(victim, -1)
    return over.sum()
