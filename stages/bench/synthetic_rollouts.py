"""Synthetic rollouts for tests and benchmarks (compaction, learner): policy-like eviction schedules.

Every schedule is produced by simulating a cache under the budget rule of `schemas.raw_masks.budget`:
prefill attends densely; at each decode query q the new key enters and, while the cache holds more
than budget(q + 1) keys, the evictable key (not a sink, not in the recent window) with the lowest
priority leaves (its evict_at = q). Policies differ only in the priority:

  dense   never evicts (every key carries the sentinel T)
  recent  priority = position: a sliding window plus sinks (identical for every layer/head)
  random  uniform random priority per key and head
  h2o     heavy-tailed (Pareto) "accumulated attention" per key and head
  snapkv  prompt keys scored in clusters (max-pooled, pooling_kernel; a schedule shape, not the policy), decode keys random
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Any

import numpy as np

from schemas.layout import RAW_MASKS, TRAJECTORIES
from schemas.params.rollout import EvictionParams
from schemas.raw_masks import budget, write_raw_masks
from schemas.tables import read_table, trajectories_binding, write_table


def budget_table(T: int, eviction: dict[str, Any]) -> np.ndarray:
    """b[n] = budget(n) for n = 0..T (b[0] = 0)."""
    return np.array([0] + [budget(n, eviction) for n in range(1, T + 1)], dtype=np.int64)


def simulate_column(T: int, prompt_len: int, eviction: dict[str, Any], priority: np.ndarray) -> np.ndarray:
    """evict_at [T] of one layer/head: evict the lowest-priority evictable key while over budget."""
    evict_at = np.full(T, T, dtype=np.int64)
    if eviction["policy"] == "dense" or T == 0:
        return evict_at
    b = budget_table(T, eviction)
    sinks, window = int(eviction["sinks"]), int(eviction["window"])
    heap: list[tuple[float, int]] = []
    cached = prompt_len
    nxt = sinks
    for q in range(prompt_len, T):
        cached += 1
        limit = q - window
        if nxt <= limit:
            for k in range(nxt, limit + 1):
                heapq.heappush(heap, (float(priority[k]), k))
            nxt = limit + 1
        while cached > b[q + 1] and heap:
            _, k = heapq.heappop(heap)
            evict_at[k] = q
            cached -= 1
    return evict_at


def _priority(policy: str, T: int, prompt_len: int, eviction: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    if policy == "recent":
        return np.arange(T, dtype=np.float64)
    if policy == "random":
        return rng.random(T)
    if policy == "h2o":
        return rng.pareto(1.0, T)
    if policy == "snapkv":
        kernel = int(eviction.get("pooling_kernel", 7))
        raw = rng.random(prompt_len) ** 4
        pad = np.pad(raw, kernel // 2, mode="edge")
        pooled = np.lib.stride_tricks.sliding_window_view(pad, kernel).max(axis=1)[:prompt_len]
        return np.concatenate([pooled, rng.random(T - prompt_len)])
    raise ValueError(f"unknown synthetic policy {policy!r}")


def synthetic_evict_at(
    policy: str,
    T: int,
    prompt_len: int,
    num_layers: int,
    num_kv_heads: int,
    eviction: dict[str, Any],
    rng: np.random.Generator,
) -> np.ndarray:
    """int32 evict_at [T, num_layers, num_kv_heads] of one row under a policy-like schedule."""
    out = np.empty((T, num_layers, num_kv_heads), dtype=np.int32)
    if policy in ("dense", "recent"):
        out[...] = simulate_column(T, prompt_len, eviction, np.arange(T, dtype=np.float64))[:, None, None]
        return out
    for layer in range(num_layers):
        for head in range(num_kv_heads):
            out[:, layer, head] = simulate_column(T, prompt_len, eviction, _priority(policy, T, prompt_len, eviction, rng))
    return out


def eviction_config(policy: str, keep_ratio: float = 0.5, **kw: Any) -> dict[str, Any]:
    return EvictionParams(policy=policy, keep_ratio=keep_ratio, **kw).model_dump()


def synthetic_rollout(
    policy: str,
    lengths: list[int],
    prompt_lens: list[int],
    *,
    num_layers: int = 4,
    num_kv_heads: int = 2,
    eviction: dict[str, Any] | None = None,
    seed: int = 0,
    num_shards: int = 1,
    permute: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, np.ndarray]], list[np.ndarray], dict[str, Any]]:
    """Trajectory rows, raw shards, per-mask_row evict_at and the eviction config of a synthetic rollout.

    mask_row is a random permutation of the table rows when `permute` (exercises row alignment); rows
    go to shards in contiguous blocks (as parallel rollout workers write them), in shuffled order.
    """
    eviction = eviction or eviction_config(policy)
    rng = np.random.default_rng(seed)
    n = len(lengths)
    mask_rows = rng.permutation(n) if permute else np.arange(n)
    per_mask_row: list[np.ndarray] = [np.empty(0)] * n
    table: list[dict[str, Any]] = []
    for i, (T, P) in enumerate(zip(lengths, prompt_lens)):
        ev = synthetic_evict_at(policy, T, P, num_layers, num_kv_heads, eviction, rng)
        per_mask_row[mask_rows[i]] = ev
        ids = rng.integers(4, 280, size=T).tolist()
        table.append(
            {
                "trajectory_id": f"traj-{i:05d}",
                "prompt_id": f"prompt-{i // 4:05d}",
                "group_index": i % 4,
                "iteration": 1,
                "task": "synthetic",
                "prompt_token_ids": ids[:P],
                "response_token_ids": ids[P:],
                "response_text": "",
                "rollout_logprobs": [-1.0] * (T - P),
                "reward": 0.0,
                "finish_reason": "length",
                "eviction_policy": eviction["policy"],
                "keep_ratio": float(eviction["keep_ratio"]),
                "max_tokens": eviction.get("max_tokens"),
                "kv_peak_tokens": int(T),
                "kv_dense_tokens": int(T),
                "mask_row": int(mask_rows[i]),
            }
        )
    shards = []
    for block in np.array_split(np.arange(n), max(1, min(num_shards, n))):
        block = rng.permutation(block)
        evs = [per_mask_row[mask_rows[i]] for i in block]
        lens = [lengths[i] for i in block]
        shards.append(
            {
                "evict_at": np.concatenate(evs) if evs else np.zeros((0, num_layers, num_kv_heads), np.int32),
                "offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                "mask_row": mask_rows[block].astype(np.int64),
                "prompt_len": np.asarray([prompt_lens[i] for i in block], dtype=np.int32),
            }
        )
    return table, shards, per_mask_row, eviction


def write_synthetic_inputs(
    directory: str | Path,
    table: list[dict[str, Any]],
    shards: list[dict[str, np.ndarray]],
    eviction: dict[str, Any],
    num_layers: int,
    num_kv_heads: int,
    raw_name: str = RAW_MASKS,
) -> tuple[Path, Path]:
    """Write trajectories.arrow and a raw store into `directory`; returns their paths."""
    directory = Path(directory)
    traj = write_table(table, directory / TRAJECTORIES, "trajectories", {"rollout": {"eviction": eviction}})
    raw = write_raw_masks(directory / raw_name, shards, num_layers, num_kv_heads, eviction,
                          trajectories_binding(read_table(traj, "trajectories")))
    return traj, raw
