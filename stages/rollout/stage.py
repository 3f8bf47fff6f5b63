"""`smdctl rollout`: sample G responses per prompt with the evicting cache and record shadow masks.

One process, or several under the launcher (see `run_rollout`). Writes, atomically as one directory
(docs/design.md §5):
  trajectories.arrow   one row per response (schemas.tables TRAJECTORIES_SCHEMA)
  masks.raw.zarr       raw shadow masks, one shard per `shard_rows` rows (schemas.raw_masks)
  metrics.json         headline (an uncached out; the DVC metric is artifacts/metrics.json): mean reward, KV kept fraction, response length, tokens/s
  details.json         every figure: reward spread, token counts, seconds (schemas.metrics)
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from schemas.errors import SmdInputError
from schemas.layout import RAW_MASKS, TRAJECTORIES
from schemas.metrics import write_metrics
from schemas.params import EvictionParams, Params, RolloutParams
from schemas.raw_masks import merge_raw_stores, write_raw_masks
from schemas.tables import read_table, schema_for, trajectories_binding, write_table
from stages.common.distributed import (
    agree,
    attempt,
    batch_seed,
    my_batches,
    worker_context,
    write_collectively,
)
from stages.common.kvcache.sampler import SampleResult, generate_batch
from stages.common.model import (
    check_positions,
    load_policy,
    load_policy_config,
    load_tokenizer,
    observation_window_tail,
)
from stages.common.scoring import Scored, Scoring, concat, term_means
from stages.common.vllm_sampler import VllmEngine, request_seed

HEADLINE = ("reward/mean", "kv/kept_fraction", "response/length_mean", "rollout/tokens_per_s")
PARTS = ".parts"  # per-process parts inside the temporary output directory, merged and removed by rank 0


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


def run_rollout(params: Params, iteration: int, policy_path: str | Path, prompts_path: str | Path,
            out_dir: str | Path, show_progress: bool = True) -> dict[str, Path]:
    """Sample `group_size` responses for each of the iteration's prompts; write trajectories, raw masks, metrics.

    Data parallel under the launcher (stages.common.distributed): the jobs (prompt, group index) are cut into
    batches of `batch_size`; batch b runs on process b mod N with a generator seeded from (seed, iteration,
    b), so every batch samples the same tokens whatever N is. Each process writes its trajectory part and
    its raw-mask part; rank 0 merges them into the canonical order (row r = job r = `mask_row` r), so the
    trajectory table and the compacted masks are the same for any N. Any failing process fails the stage
    on every process (one line naming the rank) and nothing is written.
    """
    cfg = params.rollout
    ctx = worker_context(params.model.device)  # model.device for this local rank (gloo on CPU, NCCL on CUDA)
    inputs, error = attempt(lambda: _inputs(params, iteration, policy_path, prompts_path, ctx.device))
    agree(ctx, None, error)  # bad input: one line from rank 0 (every process reads the same files)
    prompts, model, model_config, tokenizer, jobs = inputs
    batches = [jobs[s: s + cfg.batch_size] for s in range(0, len(jobs), cfg.batch_size)]
    torch.manual_seed(params.seed * 1_000_003 + iteration)
    config = {"rollout": cfg.model_dump(), "seed": params.seed, "iteration": iteration, "policy": str(policy_path)}
    num_kv = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    num_layers = model_config.num_hidden_layers

    def my_part(tmp: Path) -> dict[str, Any]:
        """Sample this process's batches; write its trajectory rows and raw-mask shards under tmp/.parts."""
        mine = my_batches(len(batches), ctx)
        handles: list[Any] = []

        def score_chunk(chunk: list[tuple[int, tuple[int, int], SampleResult, str]]) -> None:
            handles.append(scoring.submit([prompts[i] for _, (i, _), _, _ in chunk], [text for *_, text in chunk],
                                          [res.response_ids for _, _, res, _ in chunk]))

        with vllm_engine(params, policy_path, prompts, jobs) if cfg.engine == "vllm" else nullcontext() as engine:
            t0, cpu0 = time.perf_counter(), time.process_time()
            samples = generate(model, tokenizer, prompts, batches, mine, cfg, params.seed, iteration,
                               show_progress and ctx.is_main, engine, on_chunk=score_chunk)
            scored = concat([scoring.result(h) for h in handles])  # waits for a pool still scoring
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        rows = [trajectory_row(prompts[i], g, iteration, res, text, cfg.eviction, mask_row, scored, k)
                for k, (mask_row, (i, g), res, text) in enumerate(samples)]
        shards = shard_masks([(res.evict_at, res.prompt_len) for _, _, res, _ in samples], cfg.shard_rows,
                             [mask_row for mask_row, _, _, _ in samples])
        parts = tmp / PARTS
        parts.mkdir(exist_ok=True)
        # A part is not a trajectory table (its mask_row are not 0..n-1, it may be empty): plain Arrow IPC.
        schema = schema_for("trajectories", set(rows[0]) if rows else set())
        feather.write_feather(pa.Table.from_pylist(rows, schema=schema),
                              str(parts / f"trajectories-{ctx.rank:05d}.arrow"), compression="uncompressed")
        write_raw_masks(parts / f"masks-{ctx.rank:05d}.raw.zarr", shards, num_layers, num_kv, cfg.eviction.model_dump())
        return {"seconds": seconds, "cpu_seconds": cpu}

    def merge(tmp: Path, summaries: list[dict[str, Any]]) -> None:
        """Rank 0: the canonical trajectory table (sorted by mask_row), one raw store, metrics."""
        parts = tmp / PARTS
        rows = [r for rank in range(ctx.world)
                for r in feather.read_table(str(parts / f"trajectories-{rank:05d}.arrow")).to_pylist()]
        rows.sort(key=lambda r: r["mask_row"])
        write_table(rows, tmp / TRAJECTORIES, "trajectories", config)
        binding = trajectories_binding(read_table(tmp / TRAJECTORIES, "trajectories"))  # masks <-> this table
        merge_raw_stores([parts / f"masks-{rank:05d}.raw.zarr" for rank in range(ctx.world)], tmp / RAW_MASKS,
                         binding)
        shutil.rmtree(parts)
        # Wall time of the parallel phase: the slowest process's (they start together after `agree`).
        metrics = rollout_metrics(rows, iteration, max(s["seconds"] for s in summaries))
        if scoring.scorer is not None:  # each reward function's mean, as TRL logs `rewards/<name>/mean`
            metrics.update(term_means([r.get("reward_terms") for r in rows], [r.get("reward_extras") for r in rows]))
        metrics["rollout/processes"] = ctx.world
        # CPU time of all processes while sampling: what data parallelism costs besides the cores it needs.
        metrics["rollout/cpu_seconds"] = float(sum(s["cpu_seconds"] for s in summaries))
        write_metrics(tmp / "metrics.json", metrics, HEADLINE, config)

    with Scoring(params.reward, params.prepare.prompt_key) as scoring:
        config.update(scoring.record())
        write_collectively(out_dir, ctx, my_part, merge)
    out_dir = Path(out_dir)
    return {
        "trajectories": out_dir / TRAJECTORIES,
        "raw_masks": out_dir / RAW_MASKS,
        "metrics": out_dir / "metrics.json",
        "details": out_dir / "details.json",
    }


def _inputs(params: Params, iteration: int, policy_path: str | Path, prompts_path: str | Path,
            device: torch.device | str = "cpu"):
    """(prompts, model, model config, tokenizer, jobs) of an iteration, after checking that the prompts fit the
    model. With `engine: vllm` vLLM loads the weights: the model is None and only its config is read."""
    cfg = params.rollout
    prompts = read_table(prompts_path, "prompts").to_pylist()
    if cfg.engine == "vllm":
        model, model_config = None, load_policy_config(policy_path)
    else:
        model = load_policy(policy_path, params.model.dtype, device=device)
        model_config = model.config
    tokenizer = load_tokenizer(policy_path)
    picked = select_prompts(len(prompts), cfg.prompts_per_iteration, params.seed, iteration,
                            eligible_prompts(prompts, cfg.min_prompt_tokens, prompts_path))
    jobs = group_jobs(prompts, picked, cfg.group_size, model_config, cfg.max_new_tokens, prompts_path)
    observation_window_tail(cfg.eviction, tokenizer, [prompts[i]["prompt_token_ids"] for i in sorted(set(picked))],
                            prompts_path)
    return prompts, model, model_config, tokenizer, jobs


def vllm_engine(params: Params, policy_path: str | Path, prompts: list[dict[str, Any]],
                jobs: list[tuple[int, int]]) -> VllmEngine:
    """The stage's vLLM engine (`rollout.engine: vllm`, dense only): room for the longest job, `batch_size`
    sequences decoded together."""
    longest = max(len(prompts[i]["prompt_token_ids"]) for i, _ in jobs)
    return VllmEngine(policy_path, params.model.dtype, longest + params.rollout.max_new_tokens,
                      params.rollout.batch_size, params.seed)


def group_jobs(prompts: list[dict[str, Any]], picked: list[int], group_size: int, model_config, max_new_tokens: int,
               source: str | Path) -> list[tuple[int, int]]:
    """(prompt index, group index) of every response to sample, after checking the longest prompt fits."""
    longest = max(sorted(set(picked)), key=lambda i: len(prompts[i]["prompt_token_ids"]))
    n = len(prompts[longest]["prompt_token_ids"])
    check_positions(model_config, n + max_new_tokens,
                    f"{source}: prompt_token_ids: prompt {prompts[longest]['prompt_id']} has {n} tokens; with "
                    f"max_new_tokens={max_new_tokens} it")
    return [(i, g) for i in picked for g in range(group_size)]


def generate(model, tokenizer, prompts: list[dict[str, Any]], batches: list[list[tuple[int, int]]],
             mine: list[int], cfg: RolloutParams, seed: int, iteration: int,
             show_progress: bool, engine: VllmEngine | None = None,
             on_chunk: Callable[[list[tuple[int, tuple[int, int], SampleResult, str]]], None] | None = None,
             ) -> list[tuple[int, tuple[int, int], SampleResult, str]]:
    """Sample the batches `mine` (indices into `batches`) with the evicting cache, each with its own
    generator seeded by `batch_seed(seed, iteration, b)`: (mask_row = job index, job, result, decoded text).
    A vLLM `engine` (dense only) gets every row in one call and keeps `batch_size` of them decoding, refilling
    the batch as rows finish (continuous batching); each row samples with its own seed
    `request_seed(seed, iteration, row)`. `on_chunk` receives each decoded chunk at once (the stage submits it
    for scoring, so a reward pool works while the next chunk samples)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    window_tail = observation_window_tail(cfg.eviction, tokenizer)  # the prompts were checked by `_inputs`
    samples = []
    gen_tokens, t0 = 0, time.perf_counter()
    progress = Progress(TextColumn("rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[rate]}"), disable=not show_progress, transient=False)
    with progress:
        bar = progress.add_task("rollout", total=sum(len(batches[b]) for b in mine), rate="")
        for chunk in ([[b] for b in mine] if engine is None else [mine]):
            # (job index = mask_row, job); batch b's first row is job b * batch_size (only the last is short)
            rows = [(b * cfg.batch_size + j, job) for b in chunk for j, job in enumerate(batches[b])]
            ids = [list(prompts[i]["prompt_token_ids"]) for _, (i, _) in rows]
            if engine is None:
                generator = torch.Generator().manual_seed(batch_seed(seed, iteration, chunk[0]))
                results, _ = generate_batch(model, ids, cfg.eviction, cfg.max_new_tokens, eos, pad, cfg.temperature,
                                            generator, stop_check_every=cfg.stop_check_every,
                                            compile=cfg.compile, share_prompt=cfg.share_prompt,
                                            window_tail=window_tail, sampler=cfg.sampler,
                                            prefill_chunk_tokens=cfg.prefill_chunk_tokens)
            else:
                results = engine.generate(ids, cfg.max_new_tokens, eos, cfg.temperature,
                                          [request_seed(seed, iteration, row) for row, _ in rows])
            chunk_samples = []
            for (row, job), res in zip(rows, results, strict=True):
                text = tokenizer.decode([t for t in res.response_ids if t != eos], skip_special_tokens=True)
                chunk_samples.append((row, job, res, text))
                gen_tokens += len(res.response_ids)
            samples.extend(chunk_samples)
            if on_chunk is not None:
                on_chunk(chunk_samples)
            elapsed = time.perf_counter() - t0
            progress.update(bar, advance=len(rows), rate=f"{gen_tokens / max(elapsed, 1e-9):.0f} tok/s")
    return samples


def trajectory_row(prompt: dict[str, Any], group_index: int, iteration: int, res: SampleResult, text: str,
                   eviction: EvictionParams, mask_row: int, scored: Scored, k: int) -> dict[str, Any]:
    """One row of the trajectory table (schemas.tables TRAJECTORIES_SCHEMA) with its reward, `scored`'s k-th; the
    data set row (`row_json`) and each reward function's value (`reward_terms`) when there are some."""
    row = {
        "trajectory_id": f"it{iteration:03d}-{prompt['prompt_id']}-g{group_index}",
        "prompt_id": prompt["prompt_id"],
        "group_index": group_index,
        "iteration": iteration,
        "task": prompt["task"],
        "prompt_token_ids": list(prompt["prompt_token_ids"]),
        "response_token_ids": res.response_ids,
        "response_text": text,
        "rollout_logprobs": res.logprobs,
        "reward": scored.rewards[k],
        "finish_reason": res.finish_reason,
        "eviction_policy": eviction.policy,
        "keep_ratio": eviction.keep_ratio,
        "max_tokens": eviction.max_tokens,
        "kv_peak_tokens": res.kv_peak_tokens,
        "kv_dense_tokens": res.kv_dense_tokens,
        "mask_row": mask_row,
    }
    if prompt.get("row_json") is not None:
        row["row_json"] = prompt["row_json"]
    if scored.terms is not None:
        row["reward_terms"] = scored.terms[k]
    if scored.extras is not None:
        row["reward_extras"] = scored.extras[k]
    return row


def shard_masks(masks: list[tuple[np.ndarray, int]], shard_rows: int,
                mask_rows: list[int] | None = None) -> list[dict[str, np.ndarray]]:
    """Raw-store shards of `shard_rows` rows each (0 = one shard) from (evict_at [T, L, H], prompt length);
    `mask_rows` are the rows' `mask_row` (default 0, 1, ...)."""
    shard_rows = shard_rows or len(masks)
    mask_rows = list(range(len(masks))) if mask_rows is None else mask_rows
    shards = []
    for s in range(0, len(masks), shard_rows):
        part = masks[s: s + shard_rows]
        lengths = [m.shape[0] for m, _ in part]
        shards.append({
            "evict_at": np.concatenate([m for m, _ in part], axis=0),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "mask_row": np.asarray(mask_rows[s: s + len(part)], dtype=np.int64),
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
