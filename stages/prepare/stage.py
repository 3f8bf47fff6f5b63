"""`prepare` stage entry: build the train/eval prompt tables for one task."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from schemas.errors import SmdInputError
from schemas.metrics import write_metrics
from schemas.params.prepare import GENERATED_TASKS, USER_DATA_TASKS, PrepareParams
from schemas.tables import write_table
from stages.common.model import load_tokenizer, prompt_token_ids
from stages.prepare import instruct, loaders, synthetic, user_data
from stages.prepare.user_data import unique_id

GENERATORS = {**synthetic.GENERATORS, **instruct.GENERATORS}

HEADLINE = ("train.rows", "eval.rows", "train.prompt_tokens_mean", "eval.prompt_tokens_mean")

def _synthetic_rows(cfg: PrepareParams, tokenizer, seed: int, split: str, n: int) -> list[dict[str, Any]]:
    rows = []
    for i, (prompt, reference) in enumerate(synthetic.generate(cfg.task, cfg, seed, split, n, GENERATORS)):
        ids = prompt_token_ids(tokenizer, prompt, cfg.chat_template)
        rows.append(
            {
                "prompt_id": f"{cfg.task}-{split}-{i:06d}",
                "task": cfg.task,
                "prompt": prompt,
                "prompt_token_ids": ids,
                "reference": reference,
            }
        )
    return rows


def _dataset_rows(
    cfg: PrepareParams, tokenizer, examples: list[loaders.Example], split: str, limit: int, source: str
) -> tuple[list[dict[str, Any]], int]:
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    dropped = 0
    for ex in examples:
        if len(rows) >= limit:
            break
        if cfg.max_reference_chars and len(ex.reference) > cfg.max_reference_chars:
            dropped += 1
            continue
        rendered = loaders.render(ex, tokenizer, cfg.max_prompt_tokens)
        if rendered is None:
            dropped += 1
            continue
        prompt, ids = rendered
        if cfg.chat_template and getattr(tokenizer, "chat_template", None):
            ids = prompt_token_ids(tokenizer, prompt)  # the truncated text in the chat turn (+ the template's tokens)
        pid = unique_id(ex.source_id, seen)
        rows.append(
            {
                "prompt_id": pid,
                "task": cfg.task,
                "prompt": prompt,
                "prompt_token_ids": ids,
                "reference": ex.reference,
            }
        )
    if not rows:
        why = (
            f" ({dropped} examples longer than prepare.max_prompt_tokens or max_reference_chars)"
            if dropped
            else ""
        )
        raise SmdInputError(f"{source}: {split} split is empty (no usable examples){why}")
    return rows, dropped


def split_off_eval(items: list, cfg: PrepareParams, seed: int, path: Path, unit: str) -> tuple[list, list]:
    """(eval, train): `num_eval` items (at most half) split off by a seeded shuffle, when there is no eval file."""
    shuffled = list(items)
    random.Random(f"smd-prepare-split:{cfg.task}:{seed}").shuffle(shuffled)
    held_out = min(cfg.num_eval, len(shuffled) // 2)
    if held_out == 0:
        raise SmdInputError(f"{path}: eval split is empty ({len(shuffled)} {unit}; set prepare.eval_file or add "
                            f"{unit}s)")
    return shuffled[:held_out], shuffled[held_out:]


def _user_data_splits(cfg: PrepareParams, tokenizer, seed: int) -> tuple[dict[str, list], dict[str, int]]:
    """Train and eval rows of a user's data set (stages.prepare.user_data): `eval_file`, else `num_eval` rows split
    off the train file (the seeded shuffle of the other data set tasks)."""
    train_path = Path(cfg.train_file)
    train = user_data.load_rows(train_path, cfg.prompt_key, cfg.reference_key)
    if cfg.eval_file:
        eval_path = Path(cfg.eval_file)
        held = user_data.load_rows(eval_path, cfg.prompt_key, cfg.reference_key)
    else:
        eval_path = train_path
        held, train = split_off_eval(train, cfg, seed, train_path, "row")
    splits, dropped = {}, {}
    splits["train"], dropped["train"] = user_data.table_rows(cfg, tokenizer, train, cfg.num_train, str(train_path),
                                                             "train")
    splits["eval"], dropped["eval"] = user_data.table_rows(cfg, tokenizer, held, cfg.num_eval, str(eval_path), "eval")
    return splits, dropped


def _stats(rows: list[dict[str, Any]], tokenizer) -> dict[str, Any]:
    plen = [len(r["prompt_token_ids"]) for r in rows]
    rlen = [len(tokenizer(r["reference"], add_special_tokens=False)["input_ids"]) for r in rows]
    return {
        "rows": len(rows),
        "prompt_tokens_mean": sum(plen) / len(plen),
        "prompt_tokens_max": max(plen),
        "reference_tokens_mean": sum(rlen) / len(rlen),
        "reference_tokens_max": max(rlen),
    }


def run_prepare(
    cfg: PrepareParams, tokenizer_path: str | Path, out_dir: str | Path, seed: int = 0
) -> dict[str, Path]:
    """Write `train.arrow`, `eval.arrow` (prompts tables), `stats.json` (headline: rows and mean prompt tokens
    per split) and `details.json` (every statistic) under `out_dir`.

    Prompts are tokenized with the policy's tokenizer at `tokenizer_path`: through its chat template when it has
    one and `chat_template` is on (`stages.common.model.prompt_token_ids`), else the plain text (no special tokens added).
    Everything is built and validated in memory first, so bad input leaves nothing behind.
    """
    out_dir = Path(out_dir)
    tokenizer = load_tokenizer(tokenizer_path)
    dropped = {"train": 0, "eval": 0}
    if cfg.task in GENERATED_TASKS:
        splits = {
            "train": _synthetic_rows(cfg, tokenizer, seed, "train", cfg.num_train),
            "eval": _synthetic_rows(cfg, tokenizer, seed, "eval", cfg.num_eval),
        }
    elif cfg.task in USER_DATA_TASKS:
        splits, dropped = _user_data_splits(cfg, tokenizer, seed)
    else:
        train_path = Path(cfg.train_file)
        train_examples = loaders.load_examples(cfg.task, train_path)
        if not train_examples:
            raise SmdInputError(f"{train_path}: train split is empty (no records)")
        if cfg.eval_file:
            eval_path = Path(cfg.eval_file)
            eval_examples = loaders.load_examples(cfg.task, eval_path)
            if not eval_examples:
                raise SmdInputError(f"{eval_path}: eval split is empty (no records)")
        else:
            eval_path = train_path
            eval_examples, train_examples = split_off_eval(train_examples, cfg, seed, train_path, "record")
        splits = {}
        splits["train"], dropped["train"] = _dataset_rows(
            cfg, tokenizer, train_examples, "train", cfg.num_train, str(train_path)
        )
        splits["eval"], dropped["eval"] = _dataset_rows(
            cfg, tokenizer, eval_examples, "eval", cfg.num_eval, str(eval_path)
        )

    config = {"prepare": cfg.model_dump(), "seed": seed, "tokenizer": str(tokenizer_path)}
    stats = {
        "task": cfg.task,
        **{split: {**_stats(rows, tokenizer), "dropped": dropped[split]} for split, rows in splits.items()},
    }
    written: dict[str, Path] = {}
    for split, rows in splits.items():
        written[split] = write_table(rows, out_dir / f"{split}.arrow", "prompts", {**config, "split": split})
    stats_files = write_metrics(out_dir / "stats.json", stats, HEADLINE, config)
    written["stats"], written["details"] = stats_files["metrics"], stats_files["details"]
    return written
