"""`h2o` (Heavy-Hitter Oracle): keep keys with the largest accumulated attention plus a recent window.

Scores accumulate the attention every query (prefill and decoding) paid to each key, summed over the
query heads of the key's GQA group; eviction runs after prefill and after every decoding step.
"""

from __future__ import annotations

import torch

from stages.kvcache.policies.base import EvictionPolicy, LayerSlots, register_policy


@register_policy
class H2OPolicy(EvictionPolicy):
    name = "h2o"
    needs_attention = "all"

    def observe_prefill(self, layer, slots, attn):
        slots.extra["acc"] = attn.sum(dim=2).to(torch.float64)

    def observe_decode(self, layer, slots, attn):
        slots.extra["acc"] += attn[:, :, 0].to(torch.float64)

    def scores(self, layer: int, slots: LayerSlots) -> torch.Tensor:
        return slots.extra["acc"]
