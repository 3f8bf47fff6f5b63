"""Raw shadow masks (rollout shards) -> the learner-ready compacted store (`schemas.compacted_masks`).

Steps: read the trajectory table and every raw shard; check that the raw store is bound to this table (its
recorded rollout id and digest, `schemas.tables.trajectories_binding`: masks of another rollout are refused even
when their row lengths match); check that shards agree on the eviction config and shape and match the table (row count, mask_row permutation, row and prompt lengths, eviction
config); assemble rows in store order (store row r = mask_row r, so the result does not depend on the
shard order); deduplicate identical layer/head columns; validate the encoding (evict_at[k] in [k+1, T],
the budget at every decode query); compute per layer/head retention statistics; write atomically.
Any violation raises SmdInputError with one line naming the row (trajectory id), layer and head, and
leaves no output behind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from schemas.compacted_masks import RETENTION_STATS, narrowest_dtype, store_nbytes, write_mask_store
from schemas.errors import SmdInputError
from schemas.metrics import write_metrics
from schemas.params.compaction import CompactionParams
from schemas.raw_masks import budget, budget_needs_prompt_len, read_raw_masks, visible_counts
from schemas.tables import check_binding, read_table, table_config, trajectories_binding

HEADLINE = ("rows", "unique_columns", "ratio_vs_dense_bitmask", "ratio_vs_raw_int32", "tokens_per_s")


def _table_info(table, source: str, eviction: dict[str, Any]) -> dict[str, np.ndarray]:
    tid = table.column("trajectory_id").to_pylist()
    plen = pc.list_value_length(table.column("prompt_token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    rlen = pc.list_value_length(table.column("response_token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    mrow = table.column("mask_row").to_numpy().astype(np.int64)
    pol = table.column("eviction_policy").to_pylist()
    kr = table.column("keep_ratio").to_numpy(zero_copy_only=False).astype(np.float32)
    mt = table.column("max_tokens").to_pylist()
    want_kr = np.float32(eviction.get("keep_ratio", np.nan))
    for i in range(table.num_rows):
        if pol[i] != eviction.get("policy") or kr[i] != want_kr or mt[i] != eviction.get("max_tokens"):
            raise SmdInputError(
                f"{source}: row {i} (trajectory {tid[i]}): eviction {pol[i]}/keep_ratio {kr[i]:g}/max_tokens {mt[i]} "
                f"differs from the raw masks' {eviction.get('policy')}/{want_kr:g}/{eviction.get('max_tokens')}"
            )
    return {"trajectory_id": np.asarray(tid, dtype=object), "prompt_len": plen, "length": plen + rlen, "mask_row": mrow}


def _align(raw_path: Path, shards: list[dict[str, Any]], info: dict[str, np.ndarray], traj_path: Path):
    """Map each store row (= mask_row) to (shard index, row within shard) and check against the table."""
    n = len(info["mask_row"])
    total = sum(len(s["mask_row"]) for s in shards)
    if total != n:
        raise SmdInputError(f"{raw_path}: {total} mask rows in {len(shards)} shard(s) but {traj_path} has {n} trajectories")
    where = np.full((n, 2), -1, dtype=np.int64)
    for si, shard in enumerate(shards):
        for j, m in enumerate(shard["mask_row"].tolist()):
            if not 0 <= m < n:
                raise SmdInputError(f"{raw_path}/{shard['name']}/mask_row: {m} out of range 0..{n - 1}")
            if where[m, 0] >= 0:
                other = shards[where[m, 0]]["name"]
                raise SmdInputError(f"{raw_path}/{shard['name']}/mask_row: {m} also in {other} (duplicate row)")
            where[m] = (si, j)
    table_row = np.empty(n, dtype=np.int64)
    table_row[info["mask_row"]] = np.arange(n)
    for m in range(n):
        si, j = where[m]
        shard = shards[si]
        t = table_row[m]
        T = int(shard["offsets"][j + 1] - shard["offsets"][j])
        P = int(shard["prompt_len"][j])
        tid = info["trajectory_id"][t]
        if T != info["length"][t]:
            raise SmdInputError(
                f"{raw_path}/{shard['name']}: mask_row {m} (trajectory {tid}) has {T} tokens but the trajectory has "
                f"{info['length'][t]} (prompt + response)"
            )
        if P != info["prompt_len"][t]:
            raise SmdInputError(
                f"{raw_path}/{shard['name']}: mask_row {m} (trajectory {tid}): prompt_len {P} but the trajectory's "
                f"prompt has {info['prompt_len'][t]} tokens"
            )
    return where, table_row


def dedupe_columns(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[tokens, C] -> (unique [tokens, U] in first-occurrence order, map [C] into it)."""
    seen: dict[bytes, int] = {}
    cmap = np.empty(flat.shape[1], dtype=np.int32)
    keep: list[int] = []
    cols = np.ascontiguousarray(flat.T)
    for c in range(flat.shape[1]):
        key = cols[c].tobytes()
        if key not in seen:
            seen[key] = len(keep)
            keep.append(c)
        cmap[c] = seen[key]
    return np.ascontiguousarray(flat[:, keep]), cmap


class _Stats:
    """Accumulates per-column retention statistics over rows."""

    def __init__(self, num_columns: int):
        self.tokens = 0
        self.kept = np.zeros(num_columns, dtype=np.int64)
        self.frac_sum = np.zeros(num_columns, dtype=np.float64)
        self.decode_queries = 0
        self.peak = np.zeros(num_columns, dtype=np.int64)

    def add(self, ev: np.ndarray, counts: np.ndarray, prompt_len: int) -> None:
        T = ev.shape[0]
        self.tokens += T
        self.kept += (ev == T).sum(axis=0)
        if T:
            self.peak = np.maximum(self.peak, counts.max(axis=0))
        if T > prompt_len:
            q = np.arange(prompt_len, T)
            self.frac_sum += (counts[prompt_len:] / (q + 1)[:, None]).sum(axis=0)
            self.decode_queries += T - prompt_len

    def per_column(self) -> dict[str, np.ndarray]:
        return {
            "kept_final_fraction": self.kept / max(self.tokens, 1),
            "mean_visible_fraction": self.frac_sum / self.decode_queries if self.decode_queries else np.ones_like(self.frac_sum),
            "peak_visible_tokens": self.peak,
        }


def validate_rows(
    ev_flat: np.ndarray,
    offsets: np.ndarray,
    prompt_len: np.ndarray,
    column_map: np.ndarray,
    eviction: dict[str, Any],
    describe_row,
) -> _Stats:
    """Check every row's unique columns: evict_at[k] in [k+1, T]; decode queries within budget(q+1).

    `describe_row(r)` names a row in messages; the first violation (by row, then position, then
    layer/head) raises. Returns the retention statistics accumulated on the way.
    """
    U = ev_flat.shape[1]
    rep = np.full(U, -1, dtype=np.int64)  # first (layer, head) of each unique column
    flat_map = column_map.ravel()
    for idx in range(len(flat_map) - 1, -1, -1):
        rep[flat_map[idx]] = idx
    H = column_map.shape[1]

    def name(u: int) -> str:
        return f"layer {rep[u] // H}, kv_head {rep[u] % H}"

    lengths = np.diff(offsets)
    Tmax = int(lengths.max()) if len(lengths) else 0
    per_prompt = budget_needs_prompt_len(eviction)  # prefill_only or an eviction interval: the budget depends on P
    b = None if per_prompt else np.array([0] + [budget(n, eviction) for n in range(1, Tmax + 1)], dtype=np.int64)
    stats = _Stats(U)
    for r in range(len(lengths)):
        T = int(lengths[r])
        P = int(prompt_len[r])
        if per_prompt:
            b = np.array([0] + [budget(n, eviction, P) for n in range(1, T + 1)], dtype=np.int64)
        ev = ev_flat[offsets[r] : offsets[r + 1]].astype(np.int64)
        k = np.arange(T)[:, None]
        bad = (ev <= k) | (ev > T)
        if bad.any():
            kk, u = np.argwhere(bad)[0]
            v = int(ev[kk, u])
            why = f"must be > {kk} (a key is visible to its own query)" if v <= kk else f"exceeds the row length {T}"
            if v == 0:
                why += "; zero: a missing chunk?"
            raise SmdInputError(f"{describe_row(r)}, {name(u)}: evict_at[{kk}] = {v} {why}")
        counts = visible_counts(ev)
        over = counts[P:] > b[P + 1 : T + 1, None]
        if over.any():
            qq, u = np.argwhere(over)[0]
            q = P + int(qq)
            raise SmdInputError(
                f"{describe_row(r)}, {name(u)}: decode query {q} sees {counts[q, u]} keys, over the budget "
                f"{b[q + 1]} for {q + 1} tokens ({eviction.get('policy')}, keep_ratio {eviction.get('keep_ratio')})"
            )
        stats.add(ev, counts, P)
    return stats


def _per_head(values: np.ndarray, column_map: np.ndarray) -> list[list[float]]:
    if values.dtype.kind in "iu":
        return [[int(x) for x in row] for row in values[column_map]]
    return [[round(float(x), 6) for x in row] for row in values[column_map]]


def run_compaction(
    cfg: CompactionParams,
    trajectories_path: str | Path,
    raw_masks_path: str | Path,
    out_path: str | Path,
    metrics_path: str | Path | None = None,
) -> dict[str, Path]:
    """Validate raw masks against the trajectory table and write the compacted store and its metrics.

    Returns {"masks": out_path, "metrics": metrics_path, "details": details.json beside it}; metrics default
    to `metrics.json` beside the store. The metrics file holds the headline (sizes, throughput), details.json
    every figure with the per-head retention statistics (schemas.metrics).
    """
    t0 = time.perf_counter()
    traj_path, raw_path, out_path = Path(trajectories_path), Path(raw_masks_path), Path(out_path)
    metrics_path = Path(metrics_path) if metrics_path is not None else out_path.parent / "metrics.json"
    table = read_table(traj_path, "trajectories")
    attrs, shards = read_raw_masks(raw_path)
    check_binding(attrs.get("trajectories"), table, raw_path, traj_path)
    eviction = dict(attrs["eviction"])
    L, H = int(attrs["num_layers"]), int(attrs["num_kv_heads"])
    info = _table_info(table, str(traj_path), eviction)
    where, table_row = _align(raw_path, shards, info, traj_path)
    n = len(table_row)

    lengths = info["length"][table_row]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    prompt_len = info["prompt_len"][table_row]
    flat = np.empty((int(offsets[-1]), L * H), dtype=np.int64)
    for m in range(n):
        si, j = where[m]
        s = shards[si]
        flat[offsets[m] : offsets[m + 1]] = s["evict_at"][s["offsets"][j] : s["offsets"][j + 1]].reshape(-1, L * H)
    unique, cmap = dedupe_columns(flat)
    del flat
    column_map = cmap.reshape(L, H)

    def describe(r: int) -> str:
        return f"{raw_path}: mask_row {r} (trajectory {info['trajectory_id'][table_row[r]]})"

    stats = validate_rows(unique, offsets, prompt_len, column_map, eviction, describe).per_column()
    retention = {k: _per_head(v, column_map) for k, v in stats.items()}
    config = {"compaction": cfg.model_dump(), "rollout": table_config(table)}
    write_mask_store(
        out_path,
        evict_at=unique,
        offsets=offsets,
        prompt_len=prompt_len,
        table_row=table_row,
        column_map=column_map,
        eviction=eviction,
        config=config,
        retention=retention,
        chunk_rows=cfg.chunk_rows,
        compression_level=cfg.compression_level,
        trajectories=trajectories_binding(table),
    )
    seconds = time.perf_counter() - t0
    tokens = int(offsets[-1])
    nbytes = store_nbytes(out_path)
    dense_bits = int((lengths.astype(np.float64) ** 2 / 8).sum() * L * H)
    raw_int32 = tokens * L * H * 4
    metrics: dict[str, Any] = {
        "rows": n,
        "tokens": tokens,
        "unique_columns": int(unique.shape[1]),
        "layer_heads": L * H,
        "evict_at_dtype": narrowest_dtype(int(lengths.max(initial=0))).name,
        "bytes": {"compacted": nbytes, "raw_int32": raw_int32, "dense_bitmask": dense_bits},
        "ratio_vs_dense_bitmask": round(nbytes / max(dense_bits, 1), 6),
        "ratio_vs_raw_int32": round(nbytes / max(raw_int32, 1), 6),
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        "retention": {
            **{f"{k}_mean": round(float(np.mean(v[column_map])), 6) for k, v in stats.items() if k != "peak_visible_tokens"},
            "peak_visible_tokens_max": int(stats["peak_visible_tokens"].max(initial=0)),
            "per_head": {
                f"layer{layer}_head{head}": {k: retention[k][layer][head] for k in RETENTION_STATS}
                for layer in range(L)
                for head in range(H)
            },
        },
    }
    return {"masks": out_path, **write_metrics(metrics_path, metrics, HEADLINE, config)}
