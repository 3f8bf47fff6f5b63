"""Arrow table contracts: prompts and trajectories (Arrow IPC files, `pandas.read_feather` opens them).

Every table carries `schema_version`, its kind and the producing config (JSON) in its schema metadata.
Readers validate columns, types and version and fail with one line naming the file and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.feather as feather

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError

SCHEMA_VERSION = "1"

PROMPTS_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("reference", pa.string(), nullable=False),
    ]
)

TRAJECTORIES_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("group_index", pa.int32(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("eviction_policy", pa.string(), nullable=False),
        pa.field("keep_ratio", pa.float32(), nullable=False),
        pa.field("max_tokens", pa.int32(), nullable=True),
        pa.field("kv_peak_tokens", pa.int64(), nullable=False),
        pa.field("kv_dense_tokens", pa.int64(), nullable=False),
        pa.field("mask_row", pa.int64(), nullable=False),
    ]
)

# Held-out evaluation (`smdctl evaluate`): one row per (eval prompt, mode); mode is "dense" (full KV cache)
# or "compressed" (the rollout's eviction). score / exact_match follow schemas.rewards for the row's task.
EVAL_PREDICTIONS_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("mode", pa.string(), nullable=False),
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("score", pa.float64(), nullable=False),
        pa.field("exact_match", pa.bool_(), nullable=False),
        pa.field("kv_peak_tokens", pa.int64(), nullable=False),
        pa.field("kv_dense_tokens", pa.int64(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("reference", pa.string(), nullable=False),
        pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
    ]
)

KINDS = {"prompts": PROMPTS_SCHEMA, "trajectories": TRAJECTORIES_SCHEMA, "eval_predictions": EVAL_PREDICTIONS_SCHEMA}


def write_table(rows: list[dict[str, Any]] | pa.Table, path: str | Path, kind: str, config: dict | None = None) -> Path:
    """Validate and write a table atomically as Arrow IPC (Feather v2, uncompressed for pandas/mmap)."""
    schema = KINDS[kind]
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=schema)
    table = table.cast(schema)
    meta = {
        b"schema_version": SCHEMA_VERSION.encode(),
        b"kind": kind.encode(),
        b"config": json.dumps(config or {}, sort_keys=True, default=str).encode(),
    }
    table = table.replace_schema_metadata(meta)
    validate_table(table, str(path), kind)
    with atomic_path(path) as tmp:
        feather.write_feather(table, str(tmp), compression="uncompressed")
    return Path(path)


def read_table(path: str | Path, kind: str) -> pa.Table:
    """Read and validate a table; one clear line on a missing/corrupt file or a contract violation."""
    path = Path(path)
    if not path.exists():
        raise SmdInputError(f"{path}: missing {kind} table")
    try:
        table = feather.read_table(str(path), memory_map=True)
        # IPC reading trusts the file's offsets and lengths; a damaged file must fail here, not segfault later
        table.validate(full=True)
    except Exception as exc:  # noqa: BLE001
        raise SmdInputError(f"{path}: not a readable Arrow file ({exc.__class__.__name__})") from exc
    validate_table(table, str(path), kind)
    return table


def table_config(table: pa.Table) -> dict:
    return json.loads((table.schema.metadata or {}).get(b"config", b"{}"))


def validate_table(table: pa.Table, source: str, kind: str) -> None:
    schema = KINDS[kind]
    meta = table.schema.metadata or {}
    version = meta.get(b"schema_version")
    if version is None:
        raise SmdInputError(f"{source}: schema_version: missing from metadata")
    if version != SCHEMA_VERSION.encode():
        found = version.decode(errors="replace")
        raise SmdInputError(f"{source}: schema_version: {found} but this smd reads {SCHEMA_VERSION}")
    try:
        found = meta.get(b"kind", kind.encode()).decode()
        config = json.loads(meta.get(b"config", b"{}"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SmdInputError(f"{source}: metadata: unreadable kind or config ({exc.__class__.__name__})") from exc
    if found != kind:
        raise SmdInputError(f"{source}: kind: is {found}, expected {kind}")
    if not isinstance(config, dict):
        raise SmdInputError(f"{source}: config: expected a JSON object in the metadata")
    for field in schema:
        if field.name not in table.column_names:
            raise SmdInputError(f"{source}: {field.name}: missing column")
        actual = table.schema.field(field.name).type
        if actual != field.type:
            raise SmdInputError(f"{source}: {field.name}: type {actual}, expected {field.type}")
        if not field.nullable and table.column(field.name).null_count:
            raise SmdInputError(f"{source}: {field.name}: has null values")
    if table.num_rows == 0:
        raise SmdInputError(f"{source}: empty {kind} table")
    if kind == "trajectories":
        _validate_trajectories(table, source)


def _validate_trajectories(table: pa.Table, source: str) -> None:
    rewards = table.column("reward").to_pylist()
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise SmdInputError(f"{source}: reward: row {i} is {r}")
    responses = table.column("response_token_ids").to_pylist()
    logprobs = table.column("rollout_logprobs").to_pylist()
    for i, (ids, lps) in enumerate(zip(responses, logprobs)):
        if len(ids) != len(lps):
            raise SmdInputError(f"{source}: rollout_logprobs: row {i} has {len(lps)} values for {len(ids)} tokens")
        if not all(math.isfinite(x) for x in lps):
            raise SmdInputError(f"{source}: rollout_logprobs: row {i} has a non-finite value")
    mask_rows = table.column("mask_row").to_pylist()
    if sorted(mask_rows) != list(range(len(mask_rows))):
        raise SmdInputError(f"{source}: mask_row: must be a permutation of 0..{len(mask_rows) - 1}")
