"""`smdctl rollout`: sample G responses per prompt with the evicting cache and record shadow masks.

Writes, atomically as one directory (docs/design.md §5):
  trajectories.arrow   one row per response (schemas.tables TRAJECTORIES_SCHEMA)
  masks.raw.zarr       raw shadow masks, one shard per `shard_rows` rows (schemas.masks)
  metrics.json         headline (DVC metrics): mean reward, KV kept fraction, response length, tokens/s
  details.json         every figure: reward spread, token counts, seconds (schemas.metrics)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from schemas import rewards
from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from schemas.masks import write_raw_masks
from schemas.metrics import write_metrics
from schemas.params import EvictionParams, Params, RolloutParams
from schemas.tables import read_table, write_table
from stages.kvcache.engine import SampleResult, generate_batch
from stages.model import check_positions, load_policy, load_tokenizer

HEADLINE = ("reward/mean", "kv/kept_fraction", "response/length_mean", "rollout/tokens_per_s")


def select_prompts(num_prompts: int, wanted: int, seed: int, iteration: int,
                   eligible: list[int] | None = None) -> list[int]:
    """Deterministic prompt indices for an iteration: a seeded permutation of the `eligible` indices (default:
    all), cycled if too short."""
    pool = np.arange(num_prompts) if eligible is None else np.asarray(eligible)
    rng = np.random.default_rng([seed, iteration])
    order = pool[rng.permutation(len(pool))]
    return [int(order[i % len(order)]) for i in range(wanted)]


def eligible_prompts(prompts: list[dict[str, Any]], min_tokens: int, source: str | Path) -> list[int]:
    """Indices of the prompts with at least `min_tokens` tokens; one line naming the file when there is none."""
    eligible = [i for i, p in enumerate(prompts) if len(p["prompt_token_ids"]) >= min_tokens]
    if not eligible:
        longest = max((len(p["prompt_token_ids"]) for p in prompts), default=0)
        raise SmdInputError(f"{source}: prompt_token_ids: no prompt has rollout.min_prompt_tokens={min_tokens} "
                            f"tokens (the longest has {longest})")
    return eligible


def rollout(params: Params, iteration: int, policy_path: str | Path, prompts_path: str | Path,
            out_dir: str | Path, show_progress: bool = True) -> dict[str, Path]:
    """Sample `group_size` responses for each of the iteration's prompts; write trajectories, raw masks, metrics."""
    cfg = params.rollout
    prompts = read_table(prompts_path, "prompts").to_pylist()
    model = load_policy(policy_path, params.model.dtype)
    tokenizer = load_tokenizer(policy_path)
    picked = select_prompts(len(prompts), cfg.prompts_per_iteration, params.seed, iteration,
                            eligible_prompts(prompts, cfg.min_prompt_tokens, prompts_path))
    jobs = group_jobs(prompts, picked, cfg.group_size, model, cfg.max_new_tokens, prompts_path)
    torch.manual_seed(params.seed * 1_000_003 + iteration)
    generator = torch.Generator().manual_seed(params.seed * 1_000_003 + iteration)
    t0 = time.perf_counter()
    samples = generate(model, tokenizer, prompts, jobs, cfg, generator, show_progress)
    seconds = time.perf_counter() - t0
    rows = [trajectory_row(prompts[i], g, iteration, res, text, cfg.eviction, mask_row)
            for mask_row, ((i, g), res, text) in enumerate(samples)]
    shards = shard_masks([(res.evict_at, res.prompt_len) for _, res, _ in samples], cfg.shard_rows)
    metrics = rollout_metrics(rows, iteration, seconds)
    config = {"rollout": cfg.model_dump(), "seed": params.seed, "iteration": iteration, "policy": str(policy_path)}
    num_kv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    return write_rollout(out_dir, rows, shards, metrics, config, model.config.num_hidden_layers, num_kv,
                         cfg.eviction.model_dump())


def group_jobs(prompts: list[dict[str, Any]], picked: list[int], group_size: int, model, max_new_tokens: int,
               source: str | Path) -> list[tuple[int, int]]:
    """(prompt index, group index) of every response to sample, after checking the longest prompt fits."""
    longest = max(sorted(set(picked)), key=lambda i: len(prompts[i]["prompt_token_ids"]))
    n = len(prompts[longest]["prompt_token_ids"])
    check_positions(model, n + max_new_tokens,
                    f"{source}: prompt_token_ids: prompt {prompts[longest]['prompt_id']} has {n} tokens; with "
                    f"max_new_tokens={max_new_tokens} it")
    return [(i, g) for i in picked for g in range(group_size)]


def generate(model, tokenizer, prompts: list[dict[str, Any]], jobs: list[tuple[int, int]], cfg: RolloutParams,
             generator: torch.Generator, show_progress: bool) -> list[tuple[tuple[int, int], SampleResult, str]]:
    """Sample every job in batches of `cfg.batch_size` with the evicting cache: (job, result, decoded text)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    samples = []
    gen_tokens, t0 = 0, time.perf_counter()
    progress = Progress(TextColumn("rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[rate]}"), disable=not show_progress, transient=False)
    with progress:
        bar = progress.add_task("rollout", total=len(jobs), rate="")
        for start in range(0, len(jobs), cfg.batch_size):
            batch = jobs[start: start + cfg.batch_size]
            ids = [list(prompts[i]["prompt_token_ids"]) for i, _ in batch]
            results, _ = generate_batch(model, ids, cfg.eviction, cfg.max_new_tokens, eos, pad, cfg.temperature,
                                        cfg.top_k, cfg.top_p, generator)
            for job, res in zip(batch, results):
                text = tokenizer.decode([t for t in res.response_ids if t != eos], skip_special_tokens=True)
                samples.append((job, res, text))
                gen_tokens += len(res.response_ids)
            elapsed = time.perf_counter() - t0
            progress.update(bar, advance=len(batch), rate=f"{gen_tokens / max(elapsed, 1e-9):.0f} tok/s")
    return samples


def trajectory_row(prompt: dict[str, Any], group_index: int, iteration: int, res: SampleResult, text: str,
                   eviction: EvictionParams, mask_row: int) -> dict[str, Any]:
    """One row of the trajectory table (schemas.tables TRAJECTORIES_SCHEMA), scored with the task's reward."""
    return {
        "trajectory_id": f"it{iteration:03d}-{prompt['prompt_id']}-g{group_index}",
        "prompt_id": prompt["prompt_id"],
        "group_index": group_index,
        "iteration": iteration,
        "task": prompt["task"],
        "prompt_token_ids": list(prompt["prompt_token_ids"]),
        "response_token_ids": res.response_ids,
        "response_text": text,
        "rollout_logprobs": res.logprobs,
        "reward": float(rewards.score(prompt["task"], text, prompt["reference"])),
        "finish_reason": res.finish_reason,
        "eviction_policy": eviction.policy,
        "keep_ratio": eviction.keep_ratio,
        "max_tokens": eviction.max_tokens,
        "kv_peak_tokens": res.kv_peak_tokens,
        "kv_dense_tokens": res.kv_dense_tokens,
        "mask_row": mask_row,
    }


def shard_masks(masks: list[tuple[np.ndarray, int]], shard_rows: int) -> list[dict[str, np.ndarray]]:
    """Raw-store shards of `shard_rows` rows each (0 = one shard) from (evict_at [T, L, H], prompt length)."""
    shard_rows = shard_rows or len(masks)
    shards = []
    for s in range(0, len(masks), shard_rows):
        part = masks[s: s + shard_rows]
        lengths = [m.shape[0] for m, _ in part]
        shards.append({
            "evict_at": np.concatenate([m for m, _ in part], axis=0),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "mask_row": np.arange(s, s + len(part), dtype=np.int64),
            "prompt_len": np.array([pl for _, pl in part], dtype=np.int32),
        })
    return shards


def rollout_metrics(rows: list[dict[str, Any]], iteration: int, seconds: float) -> dict[str, Any]:
    """Reward, throughput and KV-cache figures of one rollout."""
    rewards_arr = np.array([r["reward"] for r in rows])
    peak = np.array([r["kv_peak_tokens"] for r in rows])
    dense = np.array([r["kv_dense_tokens"] for r in rows])
    gen_tokens = sum(len(r["response_token_ids"]) for r in rows)
    return {
        "iteration": iteration,
        "reward/mean": float(rewards_arr.mean()),
        "reward/std": float(rewards_arr.std()),
        "rollout/trajectories": len(rows),
        "rollout/generated_tokens": int(gen_tokens),
        "rollout/tokens_per_s": float(gen_tokens / max(seconds, 1e-9)),
        "rollout/seconds": float(seconds),
        "kv/peak_tokens_mean": float(peak.mean()),
        "kv/dense_tokens_mean": float(dense.mean()),
        "kv/kept_fraction": float(peak.sum() / dense.sum()),
        "response/length_mean": float(np.mean([len(r["response_token_ids"]) for r in rows])),
    }


def write_rollout(out_dir: str | Path, rows: list[dict[str, Any]], shards: list[dict[str, np.ndarray]],
                  metrics: dict[str, Any], config: dict[str, Any], num_layers: int, num_kv_heads: int,
                  eviction: dict[str, Any]) -> dict[str, Path]:
    """Write the rollout directory atomically (all files or none)."""
    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        write_table(rows, tmp / "trajectories.arrow", "trajectories", config)
        write_raw_masks(tmp / "masks.raw.zarr", shards, num_layers, num_kv_heads, eviction)
        write_metrics(tmp / "metrics.json", metrics, HEADLINE, config)
    return {
        "trajectories": out_dir / "trajectories.arrow",
        "raw_masks": out_dir / "masks.raw.zarr",
        "metrics": out_dir / "metrics.json",
        "details": out_dir / "details.json",
    }
