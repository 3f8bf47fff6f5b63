"""`dense`: no eviction (the reference policy; equals plain transformers decoding)."""

from __future__ import annotations

import torch

from stages.common.kvcache.policies.base import EvictionPolicy, LayerSlots, register_policy


@register_policy
class DensePolicy(EvictionPolicy):
    name = "dense"
    evicts = False

    def scores(self, layer: int, slots: LayerSlots) -> torch.Tensor:
        return torch.zeros(slots.slot_pos.shape, device=slots.slot_pos.device)
