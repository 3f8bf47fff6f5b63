"""`h2o` (Heavy-Hitter Oracle; Zhang et al. 2023, reference code FMInference/H2O `H2OKVCache_LayerWise`):
keep the keys with the largest accumulated attention (heavy hitters) plus the most recent tokens.

Scores accumulate the attention every query (prefill and decoding) paid to each key, summed over the
query heads of the key's GQA group (H2O sums over queries per head; kvpress's ObservedAttentionPress
divides by the number of queries that see each key, which this does not). Eviction runs after prefill and
after every decoding step. The budget is split equally between heavy hitters and recent tokens, as the
paper's experiments do (heavy ratio = recent ratio): with a budget of b keys for the next query, its
b - b // 2 newest keys (itself included) are kept and b // 2 heavy hitters among the older ones; no
attention sinks. smd v0 variant (`h2o_recent: window, sinks: 4`): a fixed `window` recent window.
"""

from __future__ import annotations

import torch

from stages.common.kvcache.policies.base import EvictionPolicy, LayerSlots, register_policy


@register_policy
class H2OPolicy(EvictionPolicy):
    name = "h2o"
    needs_attention = "all"

    def observe_prefill(self, layer, slots, attn, rows=None):
        slots.extra["acc"] = attn.sum(dim=2).to(torch.float64)

    def observe_decode(self, layer, slots, attn):
        slots.extra["acc"] += attn[:, :, 0].to(torch.float64)

    def scores(self, layer: int, slots: LayerSlots) -> torch.Tensor:
        return slots.extra["acc"]

    def recent_window(self, keep: torch.Tensor) -> torch.Tensor:
        if self.cfg.h2o_recent == "window":
            return torch.full_like(keep, self.cfg.window)
        b = keep + 1  # keys the next query sees
        return b - b // 2
