"""The `dataset` task: a user's data set in the layouts TRL and verl use (issue 33, docs/design.md §6b).

Rows come from JSON Lines, JSON (a list of rows), Parquet, or a directory written by `datasets`' `save_to_disk`
(one split's directory). Each row gives:
- the prompt, at `prepare.prompt_key` (TRL's and verl's `prompt`): a string, or a list of chat messages
  `[{"role": ..., "content": ...}]` (TRL's conversational format, verl's `prompt` column), rendered with the
  policy's chat template with the assistant turn opened;
- the reference, at `prepare.reference_key` (verl's `reward_model.ground_truth`); a TRL data set has none, and its
  reference is empty (its reward functions read their own columns). A file whose rows all have `data_source` is
  verl's layout (verl's preprocessing writes it in every row) and needs its reference: verl's reward manager reads
  `reward_model["ground_truth"]` of every row (a KeyError without it), so a verl file without the column is one
  line, not a TRL data set with empty references; `prepare.reference_key: null` says there is none;
- every column, kept whole as JSON in the prompts table's `row_json`, which the rollout carries into the
  trajectories and hands to the reward function (TRL: each column as a keyword; verl: `data_source`, `extra_info`).

A prompt longer than `prepare.max_prompt_tokens` after rendering is dropped and counted, as verl's
`data.filter_overlong_prompts` does: a generic prompt has no document that could be cut.

Bad input is one line `FILE:ROW: KEY: problem`, where ROW is the line of a JSON Lines or JSON file and the row
index (from 0, as pandas and `datasets` count) of a Parquet file or a `datasets` directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.errors import SmdInputError
from schemas.params.prepare import PrepareParams
from stages.common.model import prompt_token_ids
from stages.prepare.loaders import iter_records

DEFAULT_REFERENCE_KEY = "reward_model.ground_truth"
_MISSING = object()


@dataclass(frozen=True)
class DatasetRow:
    source_id: str
    where: str  # "FILE:ROW" for messages
    prompt: str | list[dict[str, str]]
    reference: str
    row: dict[str, Any]


def read_rows(path: Path) -> list[tuple[int, Any]]:
    """(row number, row) of every row of a data set file or `datasets` directory (module docstring)."""
    if not path.exists():
        raise SmdInputError(f"{path}: file not found")
    if path.is_dir():
        return list(enumerate(_datasets_dir(path)))
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # noqa: BLE001  (pyarrow raises several types for a damaged file)
            raise SmdInputError(f"{path}: not a readable Parquet file ({exc.__class__.__name__})") from exc
        return list(enumerate(table.to_pylist()))
    return list(iter_records(path))


def _datasets_dir(path: Path) -> list[dict[str, Any]]:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise SmdInputError(f"{path}: a DatasetDict (splits: {', '.join(splits)}); point prepare.train_file / "
                            f"eval_file at one split's directory, e.g. {path / (splits[0] if splits else 'train')}")
    if not (path / "dataset_info.json").is_file() and not (path / "state.json").is_file():
        raise SmdInputError(f"{path}: a directory that `datasets` did not write (no state.json); give a .jsonl, "
                            ".json or .parquet file or a save_to_disk directory")
    try:
        import datasets
    except ImportError as exc:
        raise SmdInputError(f"{path}: reading a `datasets` directory needs the datasets package: "
                            "pip install 'smd[data]'") from exc
    try:
        return datasets.load_from_disk(str(path)).to_list()
    except Exception as exc:  # noqa: BLE001
        raise SmdInputError(f"{path}: not a readable `datasets` directory ({exc.__class__.__name__})") from exc


def lookup(row: dict[str, Any], dotted: str) -> Any:
    """`row[a][b]` for the key `a.b` (a top-level key with dots wins); `_MISSING` when absent or null."""
    if dotted in row:
        value = row[dotted]
    else:
        value = row
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                return _MISSING
            value = value[part]
    return _MISSING if value is None else value


def _prompt(where: str, key: str, value: Any) -> str | list[dict[str, str]]:
    if value is _MISSING:
        raise SmdInputError(f"{where}: {key}: missing")
    if isinstance(value, str):
        if not value.strip():
            raise SmdInputError(f"{where}: {key}: empty")
        return value
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise SmdInputError(f"{where}: {key}: expected a string or a list of chat messages "
                            f"[{{role, content}}, ...], got {type(value).__name__}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _reference(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    return json.dumps(value, ensure_ascii=False, default=str)


def _source_id(path: Path, number: int, row: dict[str, Any]) -> str:
    for key in ("id", "_id", "extra_info.index"):
        value = lookup(row, key)
        if value is not _MISSING and isinstance(value, (str, int)) and not isinstance(value, bool):
            return f"{path.stem}-{value}" if key == "extra_info.index" else str(value)
    return f"{path.stem}-{number}"


def load_rows(path: Path, prompt_key: str, reference_key: str | None) -> list[DatasetRow]:
    """Every row of `path` with its prompt and reference (module docstring); one line on a bad row."""
    records = read_rows(path)
    if not records:
        raise SmdInputError(f"{path}: no rows")
    for number, record in records:
        if not isinstance(record, dict):
            raise SmdInputError(f"{path}:{number}: <row>: expected an object of columns, got {type(record).__name__}")
    # TRL data sets have no reference column: with the default key absent from every row, the reference is "",
    # unless the rows are verl's (data_source in every row), whose reward manager needs it (module docstring).
    optional_reference = reference_key is None or (reference_key == DEFAULT_REFERENCE_KEY and all(
        lookup(record, reference_key) is _MISSING for _, record in records))
    if reference_key is not None and optional_reference and all("data_source" in r for _, r in records):
        raise SmdInputError(f"{path}:{records[0][0]}: {reference_key}: missing in every row of a verl data set (its "
                            "rows have data_source; verl's reward manager reads the reference there): set "
                            "prepare.reference_key to the reference's column, or to null for none")
    rows = []
    for number, record in records:
        where = f"{path}:{number}"
        prompt = _prompt(where, prompt_key, lookup(record, prompt_key))
        reference = _MISSING if reference_key is None else lookup(record, reference_key)
        if reference is _MISSING and not optional_reference:
            raise SmdInputError(f"{where}: {reference_key}: missing (set prepare.reference_key to the column of the "
                                "ground truth)")
        rows.append(DatasetRow(_source_id(path, number, record), where, prompt,
                               "" if reference is _MISSING else _reference(reference), record))
    return rows


def render(row: DatasetRow, tokenizer, chat_template: bool, prompt_key: str) -> tuple[str, list[int]]:
    """(prompt text for the table, prompt token ids): a string as every task's prompt
    (`stages.common.model.prompt_token_ids`); chat messages through the tokenizer's chat template, assistant turn
    opened, with the table's `prompt` the messages as JSON."""
    if isinstance(row.prompt, str):
        return row.prompt, list(prompt_token_ids(tokenizer, row.prompt, chat_template))
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        why = "prepare.chat_template is off" if not chat_template else "the policy's tokenizer has no chat template"
        raise SmdInputError(f"{row.where}: {prompt_key}: chat messages need a chat template ({why}); give the "
                            "prompt as a string")
    ids = tokenizer.apply_chat_template(row.prompt, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return json.dumps(row.prompt, ensure_ascii=False), list(ids)


def unique_id(base: str, seen: set[str]) -> str:
    """`base`, or `base#2`, `base#3`, ... when taken; recorded in `seen`."""
    pid, k = base, 2
    while pid in seen:
        pid, k = f"{base}#{k}", k + 1
    seen.add(pid)
    return pid


def table_rows(cfg: PrepareParams, tokenizer, rows: list[DatasetRow], limit: int,
               source: str, split: str) -> tuple[list[dict[str, Any]], int]:
    """Prompts-table rows (with `row_json`) of the first `limit` usable rows, and how many were dropped as longer
    than `max_prompt_tokens`."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    dropped = 0
    for row in rows:
        if len(out) >= limit:
            break
        text, ids = render(row, tokenizer, cfg.chat_template, cfg.prompt_key)
        if len(ids) > cfg.max_prompt_tokens or (cfg.max_reference_chars and len(row.reference) > cfg.max_reference_chars):
            dropped += 1
            continue
        pid = unique_id(row.source_id, seen)
        out.append({"prompt_id": pid, "task": cfg.task, "prompt": text, "prompt_token_ids": ids,
                    "reference": row.reference, "row_json": json.dumps(row.row, ensure_ascii=False, default=str)})
    if not out:
        why = f" ({dropped} rows longer than prepare.max_prompt_tokens or max_reference_chars)" if dropped else ""
        raise SmdInputError(f"{source}: {split} split is empty (no usable rows){why}")
    return out, dropped
