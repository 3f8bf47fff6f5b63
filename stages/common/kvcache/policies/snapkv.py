"""`snapkv`: keys scored by the attention of an observation window of recent queries.

Prefill follows SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation";
reference code FasterDecoding/SnapKV `snapkv_utils.py`, also kvpress `SnapKVPress`): the last `window`
prompt queries attend to the prompt; each key *before* the window is scored by the attention it received,
summed over the window's queries and the query heads of its GQA group; the scores are pooled along the
key axis (average pooling, kernel 5, zero-padded at the edges as `F.avg_pool1d` does) so neighbours of
important tokens survive; each KV head keeps its top keys plus the whole observation window, with no
attention sinks (`sinks` 0 by default). In a left-padded batch the padding keys carry zero attention,
which is exactly the zero padding the reference pools each unpadded sequence with.

Decoding (`compress: every_step`, so the budget holds at every step) keeps the same rule with a sliding
observation window: a slot's score is the attention it received from the last `window` decoded queries
(a ring buffer; no pooling since slots are no longer in position order) and the `window` newest keys are
kept. The prompt's observation-window keys enter the ring with the row's highest prefill score, as
kvpress pads them, until `window` decoding steps have replaced that entry. `compress: prefill_only` is
the paper's original setting (compress once, keep every generated key).

With an eviction `interval` k >= `window` (amortized decode-time eviction, as kvpress's DecodingPress runs a
scorer press every `compression_interval` steps on the buffered last queries) no ring is kept: the engine
buffers the last `window` queries and, at a step that evicts, recomputes their attention over the cache
(causally: a query sees only keys cached before it). Between two evictions k >= window steps apart nothing
was evicted, so each buffered query's recomputed attention is the one it paid when it ran, and the scores are
exactly the ring's (tests/test_long_context_rollout.py), while the ring's slots x window float32 state (a quarter of a
bf16 cache's bytes at window 16 and head dimension 64) is never allocated.

`window_anchor: user_end` (smd's option, issue 42) moves the observation window before the chat template's
closing tokens (`window_tail` of them: ChatML's `<|im_end|>\n<|im_start|>assistant\n`), so its queries are the
end of the user's message rather than the template's fixed text; the closing tokens are kept as the window is.

smd v0 variant (`pooling: max, pooling_kernel: 7, snapkv_pool_scope: all_keys, sinks: 4`): max-pools over
the whole key axis, observation window included, and protects 4 sinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.common.kvcache.policies.base import EvictionPolicy, LayerSlots, register_policy


def pooled_window_scores(attn: torch.Tensor, window: int, pooling: str, kernel: int, scope: str,
                         tail: int = 0) -> torch.Tensor:
    """Pooled SnapKV key scores [B, H, P] from the window's attention [B, H, w, P] (keys in position order; the
    observation window = the `window` positions before the last `tail`, which are the prompt's last positions
    when `tail` is 0). With scope `before_window` the window's own keys are left out of the pooling and get the
    row's highest score (they are kept regardless); so do the `tail` keys after the window (`window_anchor:
    user_end`: the chat template's closing tokens, which the window's queries cannot see) with either scope."""
    summed = attn.sum(dim=2).to(torch.float64)
    P = summed.shape[-1]
    tail = min(tail, P)
    w = min(window, P - tail)
    protected = w + tail if scope == "before_window" else tail
    summed = summed[..., : P - protected]
    if kernel > 1 and summed.shape[-1] > 0:
        pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
        summed = pool(summed, kernel_size=kernel, stride=1, padding=kernel // 2)
    if protected:
        top = summed.amax(dim=-1, keepdim=True) if summed.shape[-1] else summed.new_zeros(*summed.shape[:-1], 1)
        summed = torch.cat([summed, top.expand(*summed.shape[:-1], protected)], dim=-1)
    return summed


@register_policy
class SnapKVPolicy(EvictionPolicy):
    name = "snapkv"
    needs_attention = "window"

    def __init__(self, cfg, num_layers):
        super().__init__(cfg, num_layers)
        self.ring_next: list[torch.Tensor | None] = [None] * num_layers
        # interval >= window: the buffered window's recomputed attention replaces the ring (module docstring)
        self.recomputes_window = cfg.compress == "every_step" and cfg.interval >= cfg.window
        self.window_scores: list[torch.Tensor | None] = [None] * num_layers

    def decode_observation(self) -> str:
        return "window_queries" if self.recomputes_window else "every_step"

    def observe_window(self, layer, slots, attn):
        self.window_scores[layer] = attn.to(torch.float64)

    def observe_prefill(self, layer, slots, attn, rows=None):
        # attn: [B, H, w, P] for the last w prompt queries (positions in order here).
        cfg = self.cfg
        pooled = pooled_window_scores(attn, cfg.window, cfg.pooling, cfg.pooling_kernel, cfg.snapkv_pool_scope,
                                      self.window_tail)
        if self.recomputes_window:  # the prefill's scores serve its own eviction only
            self.window_scores[layer] = pooled
            return
        B, H, P = pooled.shape
        # The ring holds the decoded queries' probabilities in their own dtype (float32: `_attend_grouped`'s
        # softmax), half the bytes of a float64 ring, and sums them in float64, which is exact: converting a
        # float32 value to float64 loses nothing. The prefill window's pooled score (float64, from the pooling)
        # is the ring's first entry, kept beside it until the `window`-th decoded query overwrites that entry.
        slots.extra["ring"] = torch.zeros(B, H, P, cfg.window, dtype=torch.float32, device=pooled.device)
        slots.extra["prefill_score"] = pooled
        # The ring entry the next decoded query writes, as a device tensor: no host value that changes every
        # step (a compiled decoding step would specialise on it and recompile).
        self.ring_next[layer] = torch.ones((1,), dtype=torch.long, device=pooled.device)

    def observe_decode(self, layer, slots, attn):
        ring, entry = slots.extra["ring"], self.ring_next[layer]
        ring.index_copy_(3, entry, attn[:, :, 0].to(ring.dtype).unsqueeze(-1))
        # writing entry 0 retires the prefill score (the ring has wrapped); a device-side multiply, no host sync
        slots.extra["prefill_score"].mul_(entry.ne(0))
        entry.add_(1).remainder_(self.cfg.window)

    def scores(self, layer: int, slots: LayerSlots) -> torch.Tensor:
        if self.recomputes_window:
            return self.window_scores[layer]
        return slots.extra["ring"].sum(dim=-1, dtype=torch.float64).add_(slots.extra["prefill_score"])

    def recent_window(self, keep: torch.Tensor) -> torch.Tensor:
        # SnapKV keeps its whole observation window: the `window` newest cached keys (v0: window - 1).
        # At the budget's floor (sinks + window) one window key has to go to make room for the next query.
        if self.cfg.snapkv_pool_scope == "all_keys":
            return torch.full_like(keep, self.cfg.window)
        return torch.clamp(torch.full_like(keep, self.cfg.window + 1), max=keep + 1)
