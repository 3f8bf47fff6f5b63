"""`random`: seeded random eviction (a baseline): each key draws a keep-priority when it is cached."""

from __future__ import annotations

import torch

from stages.common.kvcache.policies.base import EvictionPolicy, LayerSlots, register_policy


@register_policy
class RandomPolicy(EvictionPolicy):
    name = "random"
    prefill_per_row = True  # each row draws its own priorities, also over a prompt its group shares

    def __init__(self, cfg, num_layers):
        super().__init__(cfg, num_layers)
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.seed)

    def start_batch(self, batch, num_kv_heads, prompt_len, max_new_tokens, device):
        # Every priority of the batch is drawn here, on the host, in the order the layers use them (each
        # layer's prompt keys, then step by step each layer's new key): the same draws on every device, and
        # one copy to the device instead of one per layer and step.
        prompt = [torch.rand((batch, num_kv_heads, prompt_len), generator=self.generator, dtype=torch.float64,
                             device="cpu") for _ in range(self.num_layers)]
        steps = [[torch.rand((batch * num_kv_heads,), generator=self.generator, dtype=torch.float64, device="cpu")
                  for _ in range(self.num_layers)] for _ in range(max(max_new_tokens - 1, 0))]
        self.prompt_draws: list[torch.Tensor | None] = [d.to(device) for d in prompt]
        self.prompt_rows_left = [batch] * self.num_layers
        self.step_draws = [torch.stack([s[layer] for s in steps]).to(device) if steps else None
                           for layer in range(self.num_layers)]  # per layer [steps, B * H]
        # Keys inserted so far per layer, as device tensors: no host value that changes every step (a compiled
        # decoding step would specialise on it and recompile).
        self.inserted = [torch.zeros((1,), dtype=torch.long, device=device) for _ in range(self.num_layers)]

    def observe_prefill(self, layer, slots, attn, rows=None):
        draws = self.prompt_draws[layer]
        slots.extra["priority"] = draws if rows is None else draws.index_select(0, rows)
        # The layer's prompt draws ([B, H, P] float64) are dropped once every row has taken its own: the slots
        # keep what the decoding steps' evictions compare, and the batch's other layers need not hold them.
        self.prompt_rows_left[layer] -= len(draws) if rows is None else len(rows)
        if self.prompt_rows_left[layer] <= 0:
            self.prompt_draws[layer] = None

    def on_insert(self, layer, slots, batch_idx, head_idx, slot_idx):
        draw = self.step_draws[layer].index_select(0, self.inserted[layer])[0]
        slots.extra["priority"][batch_idx, head_idx, slot_idx] = draw
        self.inserted[layer].add_(1)

    def scores(self, layer: int, slots: LayerSlots) -> torch.Tensor:
        return slots.extra["priority"]
