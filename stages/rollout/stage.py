"""`smdctl rollout`: sample G responses per prompt with the evicting cache and record shadow masks.

Writes, atomically as one directory (DESIGN §5):
  trajectories.arrow   one row per response (schemas.tables TRAJECTORIES_SCHEMA)
  masks.raw.zarr       raw shadow masks, one shard per `shard_rows` rows (schemas.masks)
  metrics.json         mean reward, tokens/s, KV tokens kept vs dense
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from schemas import rewards
from schemas.atomic import atomic_path
from schemas.masks import write_raw_masks
from schemas.params import Params
from schemas.tables import read_table, write_table
from stages.kvcache.engine import generate_batch
from stages.model import check_positions, load_policy, load_tokenizer


def select_prompts(num_prompts: int, wanted: int, seed: int, iteration: int) -> list[int]:
    """Deterministic prompt indices for an iteration: a seeded permutation, cycled if too short."""
    rng = np.random.default_rng([seed, iteration])
    order = rng.permutation(num_prompts)
    return [int(order[i % num_prompts]) for i in range(wanted)]


def rollout(params: Params, iteration: int, policy_path: str | Path, prompts_path: str | Path,
            out_dir: str | Path, show_progress: bool = True) -> dict[str, Path]:
    cfg = params.rollout
    prompts = read_table(prompts_path, "prompts").to_pylist()
    model = load_policy(policy_path, params.model.dtype)
    tokenizer = load_tokenizer(policy_path)
    picked = select_prompts(len(prompts), cfg.prompts_per_iteration, params.seed, iteration)
    longest = max(sorted(set(picked)), key=lambda i: len(prompts[i]["prompt_token_ids"]))
    n = len(prompts[longest]["prompt_token_ids"])
    check_positions(model, n + cfg.max_new_tokens,
                    f"{prompts_path}: prompt_token_ids: prompt {prompts[longest]['prompt_id']} has {n} tokens; with "
                    f"max_new_tokens={cfg.max_new_tokens} it")
    jobs = [(i, g) for i in picked for g in range(cfg.group_size)]
    generator = torch.Generator().manual_seed(params.seed * 1_000_003 + iteration)
    torch.manual_seed(params.seed * 1_000_003 + iteration)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    num_layers = model.config.num_hidden_layers
    num_kv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads

    rows, masks = [], []
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
            for (i, g), res in zip(batch, results):
                p = prompts[i]
                resp = res.response_ids
                text = tokenizer.decode([t for t in resp if t != eos], skip_special_tokens=True)
                reward = rewards.score(p["task"], text, p["reference"])
                rows.append({
                    "trajectory_id": f"it{iteration:03d}-{p['prompt_id']}-g{g}",
                    "prompt_id": p["prompt_id"],
                    "group_index": g,
                    "iteration": iteration,
                    "task": p["task"],
                    "prompt_token_ids": ids[batch.index((i, g))],
                    "response_token_ids": resp,
                    "response_text": text,
                    "rollout_logprobs": res.logprobs,
                    "reward": float(reward),
                    "finish_reason": res.finish_reason,
                    "eviction_policy": cfg.eviction.policy,
                    "keep_ratio": cfg.eviction.keep_ratio,
                    "max_tokens": cfg.eviction.max_tokens,
                    "kv_peak_tokens": res.kv_peak_tokens,
                    "kv_dense_tokens": res.kv_dense_tokens,
                    "mask_row": len(rows),
                })
                masks.append((res.evict_at, res.prompt_len))
                gen_tokens += len(resp)
            elapsed = time.perf_counter() - t0
            progress.update(bar, advance=len(batch), rate=f"{gen_tokens / max(elapsed, 1e-9):.0f} tok/s")
    elapsed = time.perf_counter() - t0

    shard_rows = cfg.shard_rows or len(masks)
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
    rewards_arr = np.array([r["reward"] for r in rows])
    peak = np.array([r["kv_peak_tokens"] for r in rows])
    dense = np.array([r["kv_dense_tokens"] for r in rows])
    metrics = {
        "iteration": iteration,
        "reward/mean": float(rewards_arr.mean()),
        "reward/std": float(rewards_arr.std()),
        "rollout/trajectories": len(rows),
        "rollout/generated_tokens": int(gen_tokens),
        "rollout/tokens_per_s": float(gen_tokens / max(elapsed, 1e-9)),
        "rollout/seconds": float(elapsed),
        "kv/peak_tokens_mean": float(peak.mean()),
        "kv/dense_tokens_mean": float(dense.mean()),
        "kv/kept_fraction": float(peak.sum() / dense.sum()),
        "response/length_mean": float(np.mean([len(r["response_token_ids"]) for r in rows])),
    }
    config = {"rollout": cfg.model_dump(), "seed": params.seed, "iteration": iteration, "policy": str(policy_path)}
    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        write_table(rows, tmp / "trajectories.arrow", "trajectories", config)
        write_raw_masks(tmp / "masks.raw.zarr", shards, num_layers, num_kv, cfg.eviction.model_dump())
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    return {
        "trajectories": out_dir / "trajectories.arrow",
        "raw_masks": out_dir / "masks.raw.zarr",
        "metrics": out_dir / "metrics.json",
    }
