"""`random`: seeded random eviction (a baseline): each key draws a keep-priority when it is cached."""

from __future__ import annotations

import torch

from stages.kvcache.policies.base import EvictionPolicy, LayerSlots, register_policy


@register_policy
class RandomPolicy(EvictionPolicy):
    name = "random"

    def __init__(self, cfg, num_layers):
        super().__init__(cfg, num_layers)
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def observe_prefill(self, layer, slots, attn):
        slots.extra["priority"] = torch.rand(slots.slot_pos.shape, generator=self.generator, dtype=torch.float64)

    def on_insert(self, layer, slots, batch_idx, head_idx, slot_idx):
        draw = torch.rand(batch_idx.shape, generator=self.generator, dtype=torch.float64)
        slots.extra["priority"][batch_idx, head_idx, slot_idx] = draw

    def scores(self, layer: int, slots: LayerSlots) -> torch.Tensor:
        return slots.extra["priority"]
