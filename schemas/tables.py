"""Arrow table contracts: prompts and trajectories (Arrow IPC files, `pandas.read_feather` opens them).

Every table carries `schema_version`, its kind and the producing config (JSON) in its schema metadata.
Readers validate columns, types and version and fail with one line naming the file and the field.

Integrity (issue 24): the metadata also carries `data_digest`, the SHA-256 of the table's data (the Arrow IPC
stream of its columns, metadata stripped, chunks combined: the same bytes for the same values however the file
is chunked) and of its other metadata (version, kind, config), and `read_table` recomputes it: a flipped byte
in any value or in the config is one line naming the file, not a wrong reward or token read as valid. (A flip
in the file's alignment padding changes no value and is read as the same table.) `trajectories_binding` is the identity the mask stores record (their
rollout's id and the digest of the columns the rollout sampled), so compaction and the learner refuse masks
that belong to another rollout.
"""

from __future__ import annotations

import hashlib
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
# Optional columns, written only when a table has them (issue 33), so every existing table stays valid:
# - row_json: the data set row a prompt came from (task `dataset`), as JSON text: the prompt as given (a string or
#   chat messages) and every other column, which the reward function receives; carried into the trajectories;
# - reward_terms: with reward functions, each function's value for the row as JSON text {name: value or null};
# - reward_extras: a verl function's dict return, its keys but "score" as JSON text {"<fn>/<key>": value} (verl's
#   `reward_extra_info`), null for a row without any (issue 41).
ROW_JSON = pa.field("row_json", pa.string(), nullable=True)
REWARD_TERMS = pa.field("reward_terms", pa.string(), nullable=True)
REWARD_EXTRAS = pa.field("reward_extras", pa.string(), nullable=True)
OPTIONAL_FIELDS = {"prompts": (ROW_JSON,), "trajectories": (ROW_JSON, REWARD_TERMS, REWARD_EXTRAS),
                   "eval_predictions": (REWARD_TERMS, REWARD_EXTRAS)}


def schema_for(kind: str, columns: set[str] | list[str]) -> pa.Schema:
    """The kind's schema with the optional columns among `columns` appended."""
    schema = KINDS[kind]
    for field in OPTIONAL_FIELDS[kind]:
        if field.name in columns:
            schema = schema.append(field)
    return schema
DIGEST_KEY = b"data_digest"
# What a shadow mask describes: the sampled tokens, their log-probs and the mask row of each trajectory. The
# reward is left out on purpose: rescoring a rollout (another reward function, a test's toy reward) does not
# change which keys the rollout saw, so its masks stay valid.
SAMPLED_COLUMNS = ("trajectory_id", "prompt_id", "group_index", "iteration", "prompt_token_ids",
                   "response_token_ids", "rollout_logprobs", "eviction_policy", "keep_ratio", "max_tokens",
                   "mask_row")


def _values_digest(table: pa.Table) -> str:
    """`sha256:<hex>` of a table's values: its columns as one Arrow IPC stream, schema metadata stripped and
    chunks combined (so the digest depends on the values and types, not on how a file splits them)."""
    data = table.replace_schema_metadata(None).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema) as writer:
        writer.write_table(data)
    return "sha256:" + hashlib.sha256(sink.getvalue()).hexdigest()


def data_digest(table: pa.Table) -> str:
    """The `data_digest` of a table: its values (`_values_digest`) and its metadata but the digest itself
    (schema_version, kind, config), so a changed byte in either is caught."""
    meta = {k.decode(errors="replace"): v.decode(errors="replace")
            for k, v in sorted((table.schema.metadata or {}).items()) if k != DIGEST_KEY}
    body = json.dumps({"values": _values_digest(table), "metadata": meta}, sort_keys=True)
    return "sha256:" + hashlib.sha256(body.encode()).hexdigest()


def trajectories_binding(table: pa.Table) -> dict[str, str]:
    """The identity a mask store records of the trajectory table it belongs to: `rollout_id` (the iteration, the
    seed and a digest of the rollout's config: which rollout wrote it) and `digest` (of the sampled columns,
    `SAMPLED_COLUMNS`: which trajectories exactly)."""
    config = table_config(table)
    config_digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]
    rollout_id = f"iteration-{config.get('iteration', '?')}-seed-{config.get('seed', '?')}-{config_digest}"
    return {"rollout_id": rollout_id, "digest": _values_digest(table.select(list(SAMPLED_COLUMNS)))}


def check_binding(recorded: Any, table: pa.Table, masks_path: str | Path, table_path: str | Path) -> None:
    """Refuse, with one line naming both files, a mask store whose recorded binding is missing or is not the
    binding of `table` (masks of another rollout, even one with equal row lengths)."""
    expected = trajectories_binding(table)
    if not isinstance(recorded, dict) or not recorded.get("digest"):
        raise SmdInputError(f"{masks_path}: trajectories: not bound to a trajectory table (no digest recorded); "
                            f"cannot check it belongs to {table_path}")
    if recorded.get("digest") != expected["digest"]:
        raise SmdInputError(
            f"{masks_path}: trajectories: the masks belong to rollout {recorded.get('rollout_id')} "
            f"({str(recorded.get('digest'))[:19]}), but {table_path} is rollout {expected['rollout_id']} "
            f"({expected['digest'][:19]}): masks from another rollout")


def write_table(rows: list[dict[str, Any]] | pa.Table, path: str | Path, kind: str, config: dict | None = None) -> Path:
    """Validate and write a table atomically as Arrow IPC (Feather v2, uncompressed for pandas/mmap); the kind's
    optional columns are kept when the rows have them."""
    columns = rows.column_names if isinstance(rows, pa.Table) else (rows[0].keys() if rows else ())
    schema = schema_for(kind, set(columns))
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=schema)
    table = table.cast(schema)
    meta = {
        b"schema_version": SCHEMA_VERSION.encode(),
        b"kind": kind.encode(),
        b"config": json.dumps(config or {}, sort_keys=True, default=str).encode(),
    }
    table = table.replace_schema_metadata(meta)
    table = table.replace_schema_metadata({**meta, DIGEST_KEY: data_digest(table).encode()})
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
    validate_table(table, str(path), kind, verify_digest=True)
    return table


def table_config(table: pa.Table) -> dict:
    """The producing config recorded in a table's metadata ({} when none)."""
    return json.loads((table.schema.metadata or {}).get(b"config", b"{}"))


def validate_table(table: pa.Table, source: str, kind: str, verify_digest: bool = False) -> None:
    """Check a table against its kind's contract (one line naming `source` and the field); with
    `verify_digest`, also that its values hash to the `data_digest` in its metadata (a table read from disk)."""
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
    for field in OPTIONAL_FIELDS[kind]:
        if field.name in table.column_names and table.schema.field(field.name).type != field.type:
            raise SmdInputError(f"{source}: {field.name}: type {table.schema.field(field.name).type}, "
                                f"expected {field.type}")
    if table.num_rows == 0:
        raise SmdInputError(f"{source}: empty {kind} table")
    if kind == "trajectories":
        _validate_trajectories(table, source)
    # last: a table that breaks the contract gets the field's message; one that keeps it, whether its values
    # are the ones written
    if verify_digest:
        recorded = meta.get(DIGEST_KEY)
        if recorded is None:
            raise SmdInputError(f"{source}: data_digest: missing from metadata (written without smd's digest)")
        if recorded != data_digest(table).encode():
            raise SmdInputError(f"{source}: data_digest: the values do not match the recorded digest (the file is "
                                "damaged: a changed byte)")


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
