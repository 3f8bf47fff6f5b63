"""`snapkv`: keys scored by the attention of an observation window of recent queries.

Prefill (as in SnapKV): attention of the last `window` prompt queries, summed over the window and the
GQA group, max-pooled along keys (`pooling_kernel`) so neighbours of important tokens survive, then
per-KV-head top-k. Decoding keeps the same rule with a sliding observation window: a slot's score is the
attention it received from the last `window` decoded queries (a ring buffer, no pooling since slots are
no longer in position order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.kvcache.policies.base import EvictionPolicy, LayerSlots, register_policy


@register_policy
class SnapKVPolicy(EvictionPolicy):
    name = "snapkv"
    needs_attention = "window"

    def __init__(self, cfg, num_layers):
        super().__init__(cfg, num_layers)
        self.step = [0] * num_layers

    def observe_prefill(self, layer, slots, attn):
        # attn: [B, H, w, P] for the last w prompt queries (positions in order here).
        summed = attn.sum(dim=2).to(torch.float64)
        k = self.cfg.pooling_kernel
        pooled = F.max_pool1d(summed, kernel_size=k, stride=1, padding=k // 2) if k > 1 else summed
        B, H, P = summed.shape
        ring = torch.zeros(B, H, P, self.cfg.window, dtype=torch.float64)
        ring[..., 0] = pooled  # the prefill window's pooled score occupies one ring entry
        slots.extra["ring"] = ring
        self.step[layer] = 1

    def observe_decode(self, layer, slots, attn):
        ring = slots.extra["ring"]
        ring[..., self.step[layer] % self.cfg.window] = attn[:, :, 0].to(torch.float64)
        self.step[layer] += 1

    def scores(self, layer: int, slots: LayerSlots) -> torch.Tensor:
        return slots.extra["ring"].sum(dim=-1)
