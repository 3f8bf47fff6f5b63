"""The shadow-mask contract (docs/design.md §4–5): encoding, budget rule and the raw mask store.

Encoding. Eviction is monotone, so the [query x key] mask of one sequence, layer and KV head is one
integer per key: `evict_at[k]` = the first query position that can no longer see key k. A key never
evicted carries the sentinel `T` (the row's length: no query of the row reaches it). Query q sees key k
iff `k <= q and evict_at[k] > q`. Positions are token indices of the unpadded row (prompt + response).

Raw store (`masks.raw.zarr`, written by rollout): a Zarr v3 group with one subgroup per shard
(`shard-00000`, ...), each holding ragged rows on a flat token axis:
  evict_at   int32 [tokens, layers, kv_heads]
  offsets    int64 [rows + 1]      row r = tokens offsets[r]:offsets[r+1]
  mask_row   int64 [rows]          the trajectory table's `mask_row` of each row
  prompt_len int32 [rows]          prefill length (prefill queries attend densely)
Group and shard attributes: schema_version, kind, num_layers, num_kv_heads, eviction (the config).
Group attributes also: `trajectories` (the binding of the trajectory table the masks belong to:
`schemas.tables.trajectories_binding`, rollout id and digest; compaction refuses masks bound to another table)
and `attrs_digest` (of the other attributes). Every array chunk carries a CRC-32C (Zarr's crc32c codec), so a
flipped byte in a value is refused on read instead of read as another mask.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch only where a tensor is built: compaction and the readers run without importing it
    import torch
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError

MASK_SCHEMA_VERSION = "1"
RAW_KIND = "raw_masks"
RAW_FIELDS = ("evict_at", "offsets", "mask_row", "prompt_len")
ATTRS_DIGEST = "attrs_digest"


def attrs_digest(attrs: dict[str, Any]) -> str:
    """`sha256:<hex>` of a store's attributes (canonical JSON, without the digest itself): a flipped byte in
    zarr.json that still parses (a digit of a statistic, of the eviction config) is refused on read."""
    body = {k: v for k, v in attrs.items() if k != ATTRS_DIGEST}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def check_attrs_digest(path: str | Path, attrs: dict[str, Any]) -> None:
    """One line when a store's attributes lack their digest or do not match it."""
    recorded = attrs.get(ATTRS_DIGEST)
    if recorded is None:
        raise SmdInputError(f"{path}: attrs_digest: missing from the store's attributes (written without it)")
    if recorded != attrs_digest(attrs):
        raise SmdInputError(f"{path}: attrs_digest: the attributes do not match their digest (damaged zarr.json)")


def checksummed_codecs() -> list:
    """Raw-store compressors: zstd (Zarr's default) then a CRC-32C over each compressed chunk, checked on read."""
    return [ZstdCodec(level=0), Crc32cCodec()]


def protected_tokens(eviction: dict[str, Any]) -> int:
    """Keys a policy never evicts: attention sinks plus the recent window (0 for `dense`)."""
    if eviction["policy"] == "dense":
        return 0
    return int(eviction["sinks"]) + int(eviction["window"])


def budget(n: int, eviction: dict[str, Any], prompt_len: int | None = None) -> int:
    """Most keys a layer/head may hold once n tokens have entered the cache (see EvictionParams).

    With `compress: prefill_only` the budget after the prompt grows by one key per generated token:
    budget(P) + (n - P) for n > P = `prompt_len` (required then).

    With `interval: k > 1` (amortized eviction, as R-KV and kvpress's DecodingPress) the cache is evicted down to
    the every-step budget after the prompt and after every k-th decoding step, and grows by one key a step in
    between: for n > P + 1, budget(a) + (n - a) with a = P + 1 + floor((n - P - 1) / k) * k, the token count
    of the last eviction's next query (`prompt_len` required then). k = 1 is the every-step rule.
    """
    if eviction["policy"] == "dense":
        return n
    if eviction.get("compress", "every_step") == "prefill_only":
        if prompt_len is None:
            raise ValueError("budget(): compress=prefill_only needs the prompt length")
        if n > prompt_len:
            return budget(prompt_len, eviction, prompt_len) + (n - prompt_len)
    interval = int(eviction.get("interval", 1) or 1)
    if interval > 1:
        if prompt_len is None:
            raise ValueError("budget(): interval > 1 needs the prompt length")
        if n > prompt_len + 1:
            anchor = prompt_len + 1 + ((n - prompt_len - 1) // interval) * interval
            return min(n, _every_step_budget(anchor, eviction) + (n - anchor))
    return _every_step_budget(n, eviction)


def _every_step_budget(n: int, eviction: dict[str, Any]) -> int:
    b = max(protected_tokens(eviction), math.ceil(float(eviction["keep_ratio"]) * n - 1e-9))
    if eviction.get("max_tokens") is not None:
        b = min(b, int(eviction["max_tokens"]))
    return min(n, b)


def budget_needs_prompt_len(eviction: dict[str, Any]) -> bool:
    """Whether `budget` depends on the prompt's length (prefill_only, or an eviction interval over 1)."""
    return eviction["policy"] != "dense" and (eviction.get("compress", "every_step") == "prefill_only"
                                              or int(eviction.get("interval", 1) or 1) > 1)


def visibility(evict_at: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """Boolean [..., q, k] mask from evict_at [..., T] (key axis last): k <= q and evict_at[k] > q.

    With `length` < T the extra (padding) positions see only themselves, so softmax stays finite.
    """
    import torch

    T = evict_at.shape[-1]
    pos = torch.arange(T, device=evict_at.device)
    vis = (pos[None, :] <= pos[:, None]) & (evict_at.unsqueeze(-2) > pos[:, None])
    if length is not None and length < T:
        pad = pos >= length
        vis = vis & ~pad[None, :]
        vis = vis | (torch.eye(T, dtype=torch.bool, device=evict_at.device) & pad[:, None])
    return vis


def visible_counts(evict_at: np.ndarray) -> np.ndarray:
    """Keys visible to each query: evict_at [T, ...] -> counts [T, ...] (O(T log T) per column)."""
    T = evict_at.shape[0]
    # query q sees #{k <= q} - #{k <= q : evict_at[k] <= q}
    ends = np.clip(evict_at, 0, T).reshape(T, -1).astype(np.int64)
    C = ends.shape[1]
    # histogram of (end, column) pairs through one bincount of flat indices: np.add.at's result, ~4x faster
    # (the rollout calls this per sequence on the host: 0.9 CPU-s per 32k-token sequence with np.add.at)
    hist = np.bincount((ends * C + np.arange(C)[None, :]).ravel(), minlength=(T + 1) * C).reshape(T + 1, C)
    evicted_by = np.cumsum(hist, axis=0)[:T]  # number of keys with evict_at <= q
    seen = np.arange(1, T + 1)[:, None]
    return (seen - evicted_by).reshape(evict_at.shape)


def write_raw_masks(
    path: str | Path,
    shards: list[dict[str, np.ndarray]],
    num_layers: int,
    num_kv_heads: int,
    eviction: dict[str, Any],
    trajectories: dict[str, str] | None = None,
) -> Path:
    """Write raw shards (dicts with evict_at, offsets, mask_row, prompt_len) atomically. `trajectories` is the
    binding of the table the rows belong to (`schemas.tables.trajectories_binding`); a rollout process's part
    has none yet (`merge_raw_stores` records it), a store compaction reads must have it."""
    attrs = {
        "schema_version": MASK_SCHEMA_VERSION,
        "kind": RAW_KIND,
        "num_layers": int(num_layers),
        "num_kv_heads": int(num_kv_heads),
        "eviction": dict(eviction),
    }
    with atomic_path(path) as tmp:
        root = zarr.open_group(str(tmp), mode="w")
        root_attrs = {**attrs, "num_shards": len(shards)}
        if trajectories is not None:
            root_attrs["trajectories"] = dict(trajectories)
        root.attrs.update({**root_attrs, ATTRS_DIGEST: attrs_digest(root_attrs)})
        for i, shard in enumerate(shards):
            g = root.create_group(f"shard-{i:05d}")
            g.attrs.update(attrs)
            for name, dtype in zip(RAW_FIELDS, (np.int32, np.int64, np.int64, np.int32), strict=True):
                arr = np.ascontiguousarray(shard[name], dtype=dtype)
                g.create_array(name, data=arr, chunks=arr.shape if arr.size else None, compressors=checksummed_codecs())
    return Path(path)


def read_raw_masks(path: str | Path) -> tuple[dict[str, Any], list[dict[str, np.ndarray]]]:
    """Return (group attrs, shards) of a raw store, its shards' shapes and attrs checked against the group;
    one clear line if it is missing or malformed."""
    path = Path(path)
    if not path.exists():
        raise SmdInputError(f"{path}: missing raw mask store")
    try:
        root = zarr.open_group(str(path), mode="r")
        attrs = dict(root.attrs)
    except Exception as exc:  # noqa: BLE001
        raise SmdInputError(f"{path}: not a readable Zarr group ({exc.__class__.__name__})") from exc
    if attrs.get("kind") != RAW_KIND:
        raise SmdInputError(f"{path}: kind: expected {RAW_KIND}, found {attrs.get('kind')}")
    if attrs.get("schema_version") != MASK_SCHEMA_VERSION:
        raise SmdInputError(f"{path}: schema_version: {attrs.get('schema_version')} but this smd reads {MASK_SCHEMA_VERSION}")
    check_attrs_digest(path, attrs)
    shards = []
    for name in sorted(k for k in root.group_keys() if k.startswith("shard-")):
        g = root[name]
        shard: dict[str, Any] = {"name": name, "attrs": dict(g.attrs)}
        for field in RAW_FIELDS:
            try:
                shard[field] = g[field][...]
            except Exception as exc:  # noqa: BLE001
                raise SmdInputError(f"{path}/{name}/{field}: unreadable ({exc.__class__.__name__})") from exc
        shards.append(shard)
    if not shards:
        raise SmdInputError(f"{path}: no shards")
    _check_shards(path, attrs, shards)
    return attrs, shards


def _check_shards(path: Path, attrs: dict[str, Any], shards: list[dict[str, Any]]) -> None:
    """Every shard agrees with the group's attrs and holds consistent ragged arrays (one line on error)."""
    try:
        L, H = int(attrs["num_layers"]), int(attrs["num_kv_heads"])
        eviction = dict(attrs["eviction"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SmdInputError(f"{path}: attrs: missing or invalid {exc}") from exc
    for shard in shards:
        where = f"{path}/{shard['name']}"
        sa = shard["attrs"]
        for key, expected in (
            ("kind", RAW_KIND),
            ("schema_version", MASK_SCHEMA_VERSION),
            ("num_layers", L),
            ("num_kv_heads", H),
            ("eviction", eviction),
        ):
            if sa.get(key) != expected:
                raise SmdInputError(f"{where}: {key}: {sa.get(key)!r} differs from the store's {expected!r} (shard from another run?)")
        ev, off, mrow, plen = (shard[f] for f in RAW_FIELDS)
        if ev.ndim != 3 or ev.shape[1:] != (L, H):
            raise SmdInputError(f"{where}/evict_at: shape {ev.shape}, expected [tokens, {L}, {H}]")
        if not np.issubdtype(ev.dtype, np.integer):
            raise SmdInputError(f"{where}/evict_at: dtype {ev.dtype}, expected int32")
        n = len(mrow)
        if off.shape != (n + 1,) or plen.shape != (n,):
            raise SmdInputError(f"{where}/offsets: {off.shape[0]} offsets and {plen.shape[0]} prompt_len for {n} rows")
        if n and (off[0] != 0 or (np.diff(off) < 0).any() or off[-1] != ev.shape[0]):
            raise SmdInputError(f"{where}/offsets: must rise from 0 to the {ev.shape[0]} tokens of evict_at")


def merge_raw_stores(parts: list[str | Path], path: str | Path, trajectories: dict[str, str] | None = None) -> int:
    """Assemble one raw store at the new path `path` from raw stores written by `write_raw_masks`, one per
    rollout process: their shard groups are moved (renamed, nothing copied) and renumbered in the parts'
    order; the root keeps the parts' attributes (equal by construction) with the total `num_shards` and the
    binding `trajectories` of the table the rows belong to. Returns that number. Rows keep their `mask_row`, so compaction's result does not depend on the split."""
    path = Path(path)
    groups = [zarr.open_group(str(p), mode="r") for p in parts]
    per_part = ("num_shards", "trajectories", ATTRS_DIGEST)
    base = {k: v for k, v in dict(groups[0].attrs).items() if k not in per_part}
    for part, group in zip(parts, groups, strict=True):
        if {k: v for k, v in dict(group.attrs).items() if k not in per_part} != base:
            raise ValueError(f"{part}: raw-store attrs differ from {parts[0]}'s")
    names = [(Path(part), name) for part, group in zip(parts, groups, strict=True)
             for name in sorted(k for k in group.group_keys() if k.startswith("shard-"))]
    root = zarr.open_group(str(path), mode="w")
    root_attrs = {**base, "num_shards": len(names)}
    if trajectories is not None:
        root_attrs["trajectories"] = dict(trajectories)
    root.attrs.update({**root_attrs, ATTRS_DIGEST: attrs_digest(root_attrs)})
    for i, (part, name) in enumerate(names):
        (part / name).rename(path / f"shard-{i:05d}")
    return len(names)
