"""The compacted mask store (`masks.zarr`): compaction writes it, the learner reads it (docs/design.md §4–5).

Encoding as in `schemas.raw_masks`: per key k of a row of length T, `evict_at[k]` is the first query position
that no longer sees k, with the sentinel T for a key never evicted; query q sees k iff
`k <= q and evict_at[k] > q`.

Layout (a Zarr v3 group):

  attrs        schema_version, kind="masks", num_layers, num_kv_heads, num_rows, num_tokens, num_columns,
               evict_at_dtype, chunk_rows, chunk_tokens, eviction (the rollout's eviction config),
               config (the producing config: compaction params and the rollout table's config),
               retention (per layer/head statistics, each a [num_layers][num_kv_heads] list),
               trajectories (the binding of the trajectory table the rows belong to, copied from the raw store
               after compaction checked it: rollout id and digest; the learner refuses another table),
               attrs_digest (of all the other attributes, checked on open)
  offsets      int64 [rows + 1]              store row r = flat tokens offsets[r]:offsets[r+1]
  prompt_len   int32 [rows]                  prefill length (prefill queries attend densely)
  table_row    int64 [rows]                  row index in trajectories.arrow of store row r
  column_map   int32 [num_layers, num_kv_heads]   index of each layer/head's column in `evict_at`
  evict_at     uint8|uint16|uint32 [tokens, columns]  the narrowest unsigned dtype holding the longest
               row's sentinel; identical layer/head columns are stored once (a dense or recent-window
               policy collapses to a single column); Blosc/zstd; a chunk spans `chunk_tokens` tokens,
               the most tokens of any `chunk_rows` consecutive rows (the learner's micro-batch), so a
               micro-batch of consecutive rows touches at most two chunks. Fill value 0 (never valid:
               evict_at[k] > k >= 0), so a missing chunk is detected on read. Every array's chunks end in a
               CRC-32C (Zarr's crc32c codec after Blosc): a flipped byte is refused on read.
  kept_final   uint8 [ceil(tokens / 8), columns]  bit-packed (little bit order along the flat token
               axis): bit t = the key is still cached after the last step (evict_at == its row's T).

Row alignment: store row r holds the trajectory whose `mask_row` (trajectories.arrow) is r. Rollout
assigns mask_row = table row, so store rows follow the table's row order; `table_row` gives the inverse.

Reading (the learner): `read_mask_rows(path, rows)` returns, per requested store row, the int64
evict_at [T, num_layers, num_kv_heads] (expanded through column_map), reading only the chunks those rows
touch. A row's mask as a pandas DataFrame (columns token, layer, kv_head, evict_at, kept_final):

    from schemas.compacted_masks import mask_row_frame
    df = mask_row_frame("artifacts/iter-001/compact/masks.zarr", row=0)

The boolean [query x key] mask of one layer/head: `schemas.raw_masks.visibility(torch.from_numpy(ev[:, l, h]))`.

Concept: docs/concepts/shadow-masks.md; the contract as a table: docs/reference/artifacts.md (generated).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from schemas.raw_masks import ATTRS_DIGEST, attrs_digest, check_attrs_digest

STORE_SCHEMA_VERSION = "1"
STORE_KIND = "masks"
ARRAYS = ("offsets", "prompt_len", "table_row", "column_map", "evict_at", "kept_final")
RETENTION_STATS = {
    "kept_final_fraction": "fraction of keys still cached after the last step",
    "mean_visible_fraction": "mean over decode queries of visible keys / tokens seen",
    "peak_visible_tokens": "most keys any query saw (the KV peak of that layer/head)",
}


def narrowest_dtype(max_value: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every value in [0, max_value] exactly."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if max_value <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def chunk_tokens_for(offsets: np.ndarray, chunk_rows: int) -> int:
    """Tokens per chunk: the most tokens of any aligned block of chunk_rows rows, a multiple of 8."""
    starts = offsets[:-1:chunk_rows]
    ends = offsets[np.minimum(np.arange(len(starts)) * chunk_rows + chunk_rows, len(offsets) - 1)]
    most = int((ends - starts).max()) if len(starts) else 0
    return max(8, -(-most // 8) * 8)


def _compressor(level: int, dtype: np.dtype) -> BloscCodec:
    return BloscCodec(cname="zstd", clevel=int(level), shuffle="bitshuffle", typesize=int(dtype.itemsize))


def write_mask_store(
    path: str | Path,
    *,
    evict_at: np.ndarray,
    offsets: np.ndarray,
    prompt_len: np.ndarray,
    table_row: np.ndarray,
    column_map: np.ndarray,
    eviction: dict[str, Any],
    config: dict[str, Any],
    retention: dict[str, Any],
    chunk_rows: int = 8,
    compression_level: int = 3,
    trajectories: dict[str, str] | None = None,
) -> Path:
    """Write a validated compacted store atomically.

    `evict_at` is [tokens, columns] (unique columns, any integer dtype; narrowed here), `column_map`
    [num_layers, num_kv_heads]. The caller (stages.compaction) validates the encoding first. `trajectories`
    is the binding of the table the rows belong to (`schemas.tables.trajectories_binding`); the learner needs it.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    num_tokens, num_columns = evict_at.shape
    max_len = int(lengths.max()) if len(lengths) else 0
    dtype = narrowest_dtype(max_len)
    ev = evict_at.astype(dtype, copy=False)
    row_len = np.repeat(lengths, lengths)
    kept = evict_at == row_len[:, None]
    packed = np.packbits(kept, axis=0, bitorder="little")
    chunk_tokens = chunk_tokens_for(offsets, chunk_rows)
    column_map = np.asarray(column_map, dtype=np.int32)
    attrs = {
        "schema_version": STORE_SCHEMA_VERSION,
        "kind": STORE_KIND,
        "num_layers": int(column_map.shape[0]),
        "num_kv_heads": int(column_map.shape[1]),
        "num_rows": len(lengths),
        "num_tokens": int(num_tokens),
        "num_columns": int(num_columns),
        "evict_at_dtype": dtype.name,
        "chunk_rows": int(chunk_rows),
        "chunk_tokens": int(chunk_tokens),
        "eviction": dict(eviction),
        "config": config,
        "retention": retention,
    }
    if trajectories is not None:
        attrs["trajectories"] = dict(trajectories)
    attrs[ATTRS_DIGEST] = attrs_digest(attrs)
    with atomic_path(path) as tmp:
        root = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        root.attrs.update(attrs)

        def put(name: str, data: np.ndarray, chunks: tuple[int, ...]) -> None:
            data = np.ascontiguousarray(data)
            arr = root.create_array(
                name,
                shape=data.shape,
                dtype=data.dtype,
                chunks=tuple(max(1, c) for c in chunks),
                compressors=[_compressor(compression_level, data.dtype), Crc32cCodec()],
                fill_value=0,
            )
            if data.size:
                arr[...] = data

        put("offsets", offsets, offsets.shape)
        put("prompt_len", np.asarray(prompt_len, dtype=np.int32), (len(lengths),))
        put("table_row", np.asarray(table_row, dtype=np.int64), (len(lengths),))
        put("column_map", column_map, column_map.shape)
        put("evict_at", ev, (chunk_tokens, num_columns))
        put("kept_final", packed, (chunk_tokens // 8, num_columns))
    return Path(path)


@dataclass
class MaskStore:
    """An opened compacted store: small index arrays in memory, the token arrays read on demand."""

    path: Path
    attrs: dict[str, Any]
    offsets: np.ndarray
    prompt_len: np.ndarray
    table_row: np.ndarray
    column_map: np.ndarray
    evict_at: Any = field(repr=False)
    kept_final: Any = field(repr=False)

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_layers(self) -> int:
        return int(self.column_map.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.column_map.shape[1])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


_CACHE: dict[tuple[str, int, int], MaskStore] = {}


def open_mask_store(path: str | Path) -> MaskStore:
    """Open and validate a compacted store; one clear line naming the file and field on any problem.

    Opened stores are cached per (path, metadata file identity), so per-micro-batch reads stay cheap;
    an atomically replaced store is reopened.
    """
    path = Path(path)
    meta = path / "zarr.json"
    if not meta.exists():
        raise SmdInputError(f"{path}: missing compacted mask store (no zarr.json); run `smdctl compact`")
    st = os.stat(meta)
    key = (str(path.resolve()), st.st_ino, st.st_mtime_ns)
    if key in _CACHE:
        return _CACHE[key]
    try:
        root = zarr.open_group(str(path), mode="r")
        attrs = dict(root.attrs)
    except Exception as exc:  # noqa: BLE001
        raise SmdInputError(f"{path}: not a readable Zarr group ({exc.__class__.__name__})") from exc
    if attrs.get("kind") != STORE_KIND:
        raise SmdInputError(f"{path}: kind: expected {STORE_KIND}, found {attrs.get('kind')}")
    if attrs.get("schema_version") != STORE_SCHEMA_VERSION:
        raise SmdInputError(
            f"{path}: schema_version: {attrs.get('schema_version')} but this smd reads {STORE_SCHEMA_VERSION}"
        )
    check_attrs_digest(path, attrs)
    arrays: dict[str, Any] = {}
    for name in ARRAYS:
        try:
            arrays[name] = root[name]
        except Exception as exc:  # noqa: BLE001
            raise SmdInputError(f"{path}/{name}: missing array ({exc.__class__.__name__})") from exc
    small: dict[str, np.ndarray] = {}
    for name in ("offsets", "prompt_len", "table_row", "column_map"):
        try:
            small[name] = np.asarray(arrays[name][...])
        except Exception as exc:  # noqa: BLE001
            raise SmdInputError(f"{path}/{name}: unreadable ({exc.__class__.__name__})") from exc
    off = small["offsets"].astype(np.int64)
    n = int(attrs.get("num_rows", -1))
    if off.shape != (n + 1,) or off[0] != 0 or (np.diff(off) < 0).any() or off[-1] != arrays["evict_at"].shape[0]:
        raise SmdInputError(f"{path}/offsets: inconsistent with num_rows={n} and evict_at (damaged store?)")
    if small["prompt_len"].shape != (n,) or small["table_row"].shape != (n,):
        raise SmdInputError(f"{path}/prompt_len: expected {n} rows")
    cmap = small["column_map"].astype(np.int64)
    shape = (int(attrs.get("num_layers", -1)), int(attrs.get("num_kv_heads", -1)))
    ncol = arrays["evict_at"].shape[1] if arrays["evict_at"].ndim == 2 else -1
    if cmap.shape != shape or cmap.min(initial=0) < 0 or cmap.max(initial=0) >= ncol:
        raise SmdInputError(f"{path}/column_map: expected {shape} indices into {ncol} evict_at columns")
    store = MaskStore(
        path=path,
        attrs=attrs,
        offsets=off,
        prompt_len=small["prompt_len"].astype(np.int64),
        table_row=small["table_row"].astype(np.int64),
        column_map=cmap,
        evict_at=arrays["evict_at"],
        kept_final=arrays["kept_final"],
    )
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[key] = store
    return store


def verify_array(store: MaskStore, name: str) -> None:
    """Read array `name` whole, so that every chunk's crc32c is checked: for an array a reader does not otherwise
    read (the learner never reads `kept_final`), a damaged chunk is still one line naming it."""
    _read_slice(store, name, 0, getattr(store, name).shape[0], (0, store.num_rows - 1))


def _as_store(path: str | Path | MaskStore) -> MaskStore:
    return path if isinstance(path, MaskStore) else open_mask_store(path)


def _runs(store: MaskStore, rows: Sequence[int]) -> list[tuple[int, int]]:
    """Group sorted unique rows into [first, last] runs read as one slice (gaps under one chunk)."""
    uniq = sorted(set(rows))
    gap = int(store.attrs.get("chunk_tokens", 0))
    runs: list[list[int]] = []
    for r in uniq:
        if runs and store.offsets[r] - store.offsets[runs[-1][1] + 1] <= gap:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return [(a, b) for a, b in runs]


def _check_rows(store: MaskStore, rows: Sequence[int]) -> list[int]:
    out = [int(r) for r in rows]
    for r in out:
        if not 0 <= r < store.num_rows:
            raise SmdInputError(f"{store.path}: row {r} out of range (store has {store.num_rows} rows)")
    return out


def _read_slice(store: MaskStore, name: str, start: int, stop: int, rows: tuple[int, int]) -> np.ndarray:
    try:
        return np.asarray(getattr(store, name)[start:stop])
    except Exception as exc:  # noqa: BLE001
        raise SmdInputError(
            f"{store.path}/{name}: unreadable chunk for rows {rows[0]}..{rows[1]} ({exc.__class__.__name__})"
        ) from exc


def read_compact_rows(path: str | Path | MaskStore, rows: Sequence[int]) -> list[np.ndarray]:
    """Per requested row, the stored (deduplicated) evict_at [T, columns] in the store's narrow dtype."""
    store = _as_store(path)
    rows = _check_rows(store, rows)
    off = store.offsets
    out: dict[int, np.ndarray] = {}
    for a, b in _runs(store, rows):
        data = _read_slice(store, "evict_at", int(off[a]), int(off[b + 1]), (a, b))
        if data.size and not data.all():
            raise SmdInputError(
                f"{store.path}/evict_at: missing chunk for rows {a}..{b} (zero fill; deleted or damaged store)"
            )
        for r in range(a, b + 1):
            out[r] = data[off[r] - off[a] : off[r + 1] - off[a]]
    return [out[r] for r in rows]


def read_mask_rows(path: str | Path | MaskStore, rows: Sequence[int]) -> list[np.ndarray]:
    """For each requested store row, int64 evict_at [T_i, num_layers, num_kv_heads]; reads only needed chunks."""
    store = _as_store(path)
    return [block[:, store.column_map].astype(np.int64) for block in read_compact_rows(store, rows)]


def read_kept_final(path: str | Path | MaskStore, rows: Sequence[int]) -> list[np.ndarray]:
    """For each requested store row, bool kept_final [T_i, num_layers, num_kv_heads] from the bitmask."""
    store = _as_store(path)
    rows = _check_rows(store, rows)
    off = store.offsets
    out = []
    for r in rows:
        s, e = int(off[r]), int(off[r + 1])
        packed = _read_slice(store, "kept_final", s // 8, -(-e // 8), (r, r))
        bits = np.unpackbits(packed, axis=0, bitorder="little").astype(bool)
        out.append(bits[s - (s // 8) * 8 : e - (s // 8) * 8][:, store.column_map])
    return out


def mask_row_frame(path: str | Path | MaskStore, row: int):
    """One row's mask as a long pandas DataFrame: token, layer, kv_head, evict_at, kept_final."""
    import pandas as pd

    store = _as_store(path)
    ev = read_mask_rows(store, [row])[0]
    kept = read_kept_final(store, [row])[0]
    T, L, H = ev.shape
    if not np.array_equal(kept, ev == T):
        raise SmdInputError(f"{store.path}/kept_final: row {row} disagrees with evict_at (damaged store?)")
    tok, lay, head = np.meshgrid(np.arange(T), np.arange(L), np.arange(H), indexing="ij")
    return pd.DataFrame(
        {
            "token": tok.ravel(),
            "layer": lay.ravel(),
            "kv_head": head.ravel(),
            "evict_at": ev.ravel(),
            "kept_final": kept.ravel(),
        }
    )


def retention_frame(path: str | Path | MaskStore):
    """Per layer/head retention statistics (from the store's attrs) as a pandas DataFrame."""
    import pandas as pd

    store = _as_store(path)
    ret = store.attrs.get("retention", {})
    recs = []
    for layer in range(store.num_layers):
        for head in range(store.num_kv_heads):
            rec: dict[str, Any] = {"layer": layer, "kv_head": head, "column": int(store.column_map[layer, head])}
            for name in RETENTION_STATS:
                if name in ret:
                    rec[name] = ret[name][layer][head]
            recs.append(rec)
    return pd.DataFrame(recs)


def store_nbytes(path: str | Path) -> int:
    """Bytes on disk of a store directory (all chunks and metadata)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
