"""The budget schedule of one sampling batch, computed on the host once, before the batch runs.

Every layer and KV head inserts one key per decoding step and evicts down to the same keep count, and that
count depends only on positions (the budget rule of `schemas.raw_masks.budget`), never on what was sampled. So
the keep count of every step, and how far over it the cache can be, are known before the first token:
the decode loop reads them from tensors instead of computing a Python list per step, and decides on the
host, without a device sync, whether a step evicts at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.raw_masks import protected_tokens


def budget_array(n: np.ndarray, eviction: dict[str, Any], prompt_len: np.ndarray) -> np.ndarray:
    """`schemas.raw_masks.budget` elementwise: the most keys a layer/head may hold once n tokens entered the cache.

    The same float64 arithmetic as the scalar rule (ceil(keep_ratio * n - 1e-9)), so the two agree exactly
    (tests/test_engine_device.py checks every n up to a few thousand against it), `interval` included.
    """
    n = np.asarray(n, dtype=np.int64)
    prompt_len = np.broadcast_to(np.asarray(prompt_len, dtype=np.int64), n.shape)
    if eviction["policy"] == "dense":
        return n.copy()
    if eviction.get("compress", "every_step") == "prefill_only":
        after = n > prompt_len
        at_prompt = _compressed_budget(prompt_len, eviction)
        return np.where(after, at_prompt + (n - prompt_len), _compressed_budget(n, eviction))
    interval = int(eviction.get("interval", 1) or 1)
    if interval > 1:  # evicted after the prompt and every `interval` steps, one key a step in between
        decoding = n > prompt_len + 1
        anchor = np.where(decoding, prompt_len + 1 + ((n - prompt_len - 1) // interval) * interval, n)
        return np.minimum(n, _compressed_budget(anchor, eviction) + (n - anchor))
    return _compressed_budget(n, eviction)


def _compressed_budget(n: np.ndarray, eviction: dict[str, Any]) -> np.ndarray:
    ratio = float(eviction["keep_ratio"])
    b = np.maximum(protected_tokens(eviction), np.ceil(ratio * n.astype(np.float64) - 1e-9).astype(np.int64))
    if eviction.get("max_tokens") is not None:
        b = np.minimum(b, int(eviction["max_tokens"]))
    return np.minimum(n, b)


@dataclass(frozen=True)
class BudgetSchedule:
    """Keep counts of one batch: after prefill, and after each decoding step.

    prefill_keep [B]: keys each sequence may keep after its prompt (so its first response query sees <= budget).
    step_keep [S, B]: keys kept after decoding step s (S = max_new_tokens - 1 steps feed a token).
    step_excess [S]: most keys any sequence is over its keep count at step s, before eviction (0: nothing to
    evict that step, 1: at most one victim per layer/head, the fast path of `evict`).
    capacity: physical slots per (sequence, KV head), the largest budget any query of the batch has (the budget at
    the longest length when it only grows; with `interval` k > 1 the cache's size just before an eviction).
    """

    prefill_keep: np.ndarray
    step_keep: np.ndarray
    step_excess: list[int]
    capacity: int


def budget_schedule(prompt_lens: np.ndarray, max_new_tokens: int, eviction: dict[str, Any], evicts: bool,
                    evicts_while_decoding: bool) -> BudgetSchedule:
    """The schedule of a batch with these prompt lengths (see `BudgetSchedule`).

    keep_after(n) = budget(n + 1) - 1 is what a cache that has seen n tokens may keep so that the next query
    (n + 1 tokens) sees at most the budget. Decoding step s feeds the token at position P + s and evicts down
    to keep_after(P + s + 1).
    """
    lens = np.asarray(prompt_lens, dtype=np.int64)
    steps = max(max_new_tokens - 1, 0)
    prefill_keep = budget_array(lens + 1, eviction, lens) - 1
    n_seen = lens[None, :] + np.arange(steps, dtype=np.int64)[:, None] + 1  # [S, B]
    step_keep = budget_array(n_seen + 1, eviction, lens[None, :]) - 1
    cached = np.minimum(lens, prefill_keep) if evicts else lens.copy()
    excess: list[int] = []
    for s in range(steps):
        cached = cached + 1  # this step's key, in every layer and head
        if evicts_while_decoding:
            excess.append(int(np.max(cached - step_keep[s])))
            cached = np.minimum(cached, step_keep[s])
        else:
            excess.append(0)
    # The largest budget of any length up to the longest: the last one's unless an interval makes it a sawtooth
    # (largest just before an eviction).
    every_n = lens[None, :] + np.arange(min(1, max_new_tokens), max_new_tokens + 1, dtype=np.int64)[:, None]
    capacity = int(np.max(budget_array(every_n, eviction, lens[None, :])))
    return BudgetSchedule(prefill_keep=prefill_keep, step_keep=step_keep, step_excess=excess, capacity=capacity)
