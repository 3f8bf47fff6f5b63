"""`recent`: attention sinks plus a sliding window (StreamingLLM): evict the oldest non-sink key."""

from __future__ import annotations

import torch

from stages.common.kvcache.policies.base import EvictionPolicy, LayerSlots, register_policy


@register_policy
class RecentPolicy(EvictionPolicy):
    name = "recent"

    def scores(self, layer: int, slots: LayerSlots) -> torch.Tensor:
        return slots.slot_pos.to(torch.float64)
