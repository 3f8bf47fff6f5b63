"""`smdctl inspect PATH`: what an artifact is and its key statistics (tables and mask stores)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.feather as feather
import zarr

from schemas.compacted_masks import (
    RETENTION_STATS,
    STORE_KIND,
    open_mask_store,
    retention_frame,
    store_nbytes,
)
from schemas.errors import SmdInputError
from schemas.raw_masks import RAW_KIND, read_raw_masks, visible_counts
from schemas.tables import KINDS, read_table, table_config


def _describe(values: np.ndarray) -> str:
    if len(values) == 0:
        return "-"
    return f"mean {values.mean():.4g}, min {values.min():.4g}, max {values.max():.4g}"


def _counts(values: list) -> str:
    uniq, cnt = np.unique(np.asarray(values, dtype=object).astype(str), return_counts=True)
    return ", ".join(f"{u}: {c}" for u, c in zip(uniq, cnt))


def _lengths(table, column: str) -> np.ndarray:
    return pc.list_value_length(table.column(column)).to_numpy(zero_copy_only=False)


def _inspect_table(path: Path) -> dict[str, Any]:
    try:
        meta = feather.read_table(str(path), memory_map=True).schema.metadata or {}
    except Exception as exc:  # noqa: BLE001
        raise SmdInputError(f"{path}: not a readable Arrow file ({exc.__class__.__name__})") from exc
    kind = meta.get(b"kind", b"").decode()
    if kind not in KINDS:
        raise SmdInputError(f"{path}: kind: {kind or 'missing'}, expected one of {', '.join(KINDS)}")
    table = read_table(path, kind)
    stats: dict[str, str] = {"columns": ", ".join(table.column_names)}
    if kind == "prompts":
        stats["tasks"] = _counts(table.column("task").to_pylist())
        stats["prompt tokens"] = _describe(_lengths(table, "prompt_token_ids"))
    elif kind == "trajectories":
        stats["prompts"] = str(len(set(table.column("prompt_id").to_pylist())))
        stats["iteration"] = _counts(table.column("iteration").to_pylist())
        stats["prompt tokens"] = _describe(_lengths(table, "prompt_token_ids"))
        stats["response tokens"] = _describe(_lengths(table, "response_token_ids"))
        stats["reward"] = _describe(table.column("reward").to_numpy())
        stats["finish_reason"] = _counts(table.column("finish_reason").to_pylist())
        stats["eviction"] = _counts(
            [f"{p}@{k:g}" for p, k in zip(table.column("eviction_policy").to_pylist(), table.column("keep_ratio").to_pylist())]
        )
        peak = table.column("kv_peak_tokens").to_numpy().astype(float)
        dense = np.maximum(table.column("kv_dense_tokens").to_numpy().astype(float), 1)
        stats["kv peak / dense"] = _describe(peak / dense)
        lps = pc.list_flatten(table.column("rollout_logprobs")).to_numpy(zero_copy_only=False)
        stats["rollout logprob"] = _describe(lps)
    else:  # any other table kind: numbers described, few-valued strings counted, lists by length
        for f in table.schema:
            col = table.column(f.name)
            if pa.types.is_list(f.type):
                stats[f"{f.name} (length)"] = _describe(_lengths(table, f.name))
            elif pa.types.is_integer(f.type) or pa.types.is_floating(f.type) or pa.types.is_boolean(f.type):
                stats[f.name] = _describe(col.to_numpy(zero_copy_only=False).astype(float))
            elif pa.types.is_string(f.type) and len(set(col.to_pylist())) <= 8:
                stats[f.name] = _counts(col.to_pylist())
    return {
        "path": str(path),
        "kind": kind,
        "schema_version": (meta.get(b"schema_version") or b"?").decode(),
        "rows": table.num_rows,
        "stats": stats,
        "config": table_config(table),
        "per_head": None,
    }


def _raw_retention(shards: list[dict[str, Any]], L: int, H: int) -> list[dict[str, Any]]:
    kept = np.zeros(L * H)
    frac = np.zeros(L * H)
    peak = np.zeros(L * H, dtype=np.int64)
    tokens = decode = 0
    for s in shards:
        off = s["offsets"]
        for j in range(len(s["mask_row"])):
            ev = s["evict_at"][off[j] : off[j + 1]].reshape(-1, L * H).astype(np.int64)
            T, P = ev.shape[0], int(s["prompt_len"][j])
            if T == 0:
                continue
            counts = visible_counts(ev)
            tokens += T
            kept += (ev == T).sum(0)
            peak = np.maximum(peak, counts.max(0))
            if T > P:
                frac += (counts[P:] / np.arange(P + 1, T + 1)[:, None]).sum(0)
                decode += T - P
    return [
        {
            "layer": c // H,
            "kv_head": c % H,
            "kept_final_fraction": kept[c] / max(tokens, 1),
            "mean_visible_fraction": frac[c] / decode if decode else 1.0,
            "peak_visible_tokens": int(peak[c]),
        }
        for c in range(L * H)
    ]


def _inspect_zarr(path: Path) -> dict[str, Any]:
    try:
        attrs = dict(zarr.open_group(str(path), mode="r").attrs)
    except Exception as exc:  # noqa: BLE001
        raise SmdInputError(f"{path}: not a readable Zarr group ({exc.__class__.__name__})") from exc
    kind = attrs.get("kind")
    if kind == STORE_KIND:
        store = open_mask_store(path)
        lengths = store.lengths()
        stats = {
            "layers x kv_heads": f"{store.num_layers} x {store.num_kv_heads}",
            "tokens": str(int(store.offsets[-1])),
            "row tokens": _describe(lengths),
            "prompt tokens": _describe(store.prompt_len),
            "unique columns": f"{attrs.get('num_columns')} of {store.num_layers * store.num_kv_heads}",
            "evict_at dtype": str(attrs.get("evict_at_dtype")),
            "chunks": f"{attrs.get('chunk_rows')} rows / {attrs.get('chunk_tokens')} tokens",
            "eviction": str(attrs.get("eviction")),
            "bytes on disk": str(store_nbytes(path)),
        }
        per_head = retention_frame(store).to_dict("records")
        return {
            "path": str(path),
            "kind": kind,
            "schema_version": attrs.get("schema_version"),
            "rows": store.num_rows,
            "stats": stats,
            "config": attrs.get("config"),
            "per_head": per_head,
        }
    if kind == RAW_KIND:
        attrs, shards = read_raw_masks(path)
        L, H = int(attrs["num_layers"]), int(attrs["num_kv_heads"])
        lengths = np.concatenate([np.diff(s["offsets"]) for s in shards])
        stats = {
            "shards": ", ".join(f"{s['name']}: {len(s['mask_row'])} rows" for s in shards),
            "layers x kv_heads": f"{L} x {H}",
            "tokens": str(int(lengths.sum())),
            "row tokens": _describe(lengths),
            "eviction": str(attrs.get("eviction")),
            "bytes on disk": str(store_nbytes(path)),
        }
        return {
            "path": str(path),
            "kind": kind,
            "schema_version": attrs.get("schema_version"),
            "rows": int(len(lengths)),
            "stats": stats,
            "config": None,
            "per_head": _raw_retention(shards, L, H),
        }
    raise SmdInputError(f"{path}: kind: {kind!r} is not a mask store ({RAW_KIND} or {STORE_KIND})")


def inspect_artifact(path: str | Path) -> dict[str, Any]:
    """Summary of a prompts/trajectories table or a raw/compacted mask store (one line on bad input)."""
    path = Path(path)
    if not path.exists():
        raise SmdInputError(f"{path}: no such artifact")
    if path.is_dir():
        if not (path / "zarr.json").exists():
            raise SmdInputError(f"{path}: a directory but not a Zarr store (no zarr.json)")
        return _inspect_zarr(path)
    return _inspect_table(path)


def render(summary: dict[str, Any], console) -> None:
    """Print a summary with rich."""
    from rich.table import Table

    head = Table(title=f"{summary['path']}", show_header=False, title_justify="left")
    head.add_column("field", style="bold")
    head.add_column("value")
    head.add_row("kind", str(summary["kind"]))
    head.add_row("schema_version", str(summary["schema_version"]))
    head.add_row("rows", str(summary["rows"]))
    for key, value in summary["stats"].items():
        head.add_row(key, value)
    console.print(head)
    if summary["per_head"]:
        t = Table(title="retention per layer / kv head", title_justify="left")
        cols = ["layer", "kv_head"] + (["column"] if "column" in summary["per_head"][0] else []) + list(RETENTION_STATS)
        labels = {"kept_final_fraction": "kept_final", "mean_visible_fraction": "visible frac", "peak_visible_tokens": "peak"}
        for c in cols:
            t.add_column(labels.get(c, c), justify="right")
        for rec in summary["per_head"]:
            t.add_row(*(f"{rec[c]:.4f}" if isinstance(rec.get(c), float) else str(rec.get(c, "-")) for c in cols))
        console.print(t)
