"""The trusted-token filter of the SMD authors' released code (`learner.objective: smd_released`).

Source: huthvincent/RL-Post-Training-with-KV-Cache-Compression, commit 26029e8bf9d5140ee8948cbc645d8b3414bbc994
(2026-03-14), SMD/src/shadow_distillation_loss.py, "构建 shadow token mask": for a sample with prompt length P and
response length R (T = P + R) and its (T, T) boolean shadow mask `sm` (SMD/src/shadow_mask_interceptor.py: one mask
per sequence, shared by every layer and head), the response token i is "trusted" (on-policy faithful) when

    visibility_i = sm[P + i, :T].sum() / T  <=  retention_ratio + 0.05

computed in float32 (`resp_mask.float().sum(dim=-1) / total_len`, compared with a python float: torch promotes the
scalar to float32). The row is the query at P + i (the one that attends *from* token i, not the one that predicts
it: the file's indexing, kept as it is), and the count includes the query's own key (the mask's diagonal).

smd's shadow mask is one `evict_at` per (layer, KV head) (docs/design.md section 4): query q sees key k iff
k <= q and evict_at[k] > q. The row count here is the mean over the (layer, KV head) pairs of the keys query q
sees; with one mask shared by every pair (the released code's) it is that mask's row count, so the two coincide.
"""

from __future__ import annotations

import numpy as np

from schemas.errors import SmdInputError

__all__ = ["released_visibility", "released_trusted"]


def released_visibility(evict_at: np.ndarray, prompt_len: int) -> np.ndarray:
    """Per response token i (0-based), the released code's visibility ratio in float32: the number of keys the query
    at position prompt_len + i sees (mean over the (layer, KV head) pairs of `evict_at [T, L, H]`), divided by T.

    Computed without the T x T mask: the keys q sees are q + 1 minus those evicted by q (evict_at[k] <= q; any such
    k is < q since evict_at[k] > k), counted over all pairs from one histogram of evict_at: O(T L H)."""
    ev = np.asarray(evict_at)
    if ev.ndim != 3:
        raise SmdInputError(f"evict_at: expected shape [T, L, H], got {ev.shape}")
    T, L, H = ev.shape
    if not 0 < prompt_len <= T:
        raise SmdInputError(f"prompt_len {prompt_len} is not within the {T}-token sequence")
    pos = np.arange(T).reshape(T, 1, 1)
    if not ((ev > pos) & (ev <= T)).all():
        raise SmdInputError(f"evict_at: not a shadow mask of {T} tokens (need k < evict_at[k] <= T)")
    evicted_by = np.cumsum(np.bincount(ev.ravel(), minlength=T + 1))  # [q]: entries with evict_at <= q
    q = np.arange(prompt_len, T)
    seen = ((q + 1) * (L * H) - evicted_by[q]) / (L * H)  # float64: exact for a mask shared by every pair
    return seen.astype(np.float32) / np.float32(T)


def released_trusted(visibility: np.ndarray, retention: float, margin: float) -> np.ndarray:
    """The released filter: visibility <= retention + margin, compared in float32 as the file's torch code does."""
    if not 0 < retention <= 1 or margin < 0:
        raise SmdInputError(f"smd_released filter: need 0 < retention <= 1 and margin >= 0, got {retention}, {margin}")
    return np.asarray(visibility, dtype=np.float32) <= np.float32(retention + margin)
