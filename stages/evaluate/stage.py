"""`smdctl evaluate`: greedy held-out evaluation of a policy, with the dense and with the compressed KV cache.

Both modes decode the same eval prompts greedily (temperature 0) through the rollout engine
(stages.common.kvcache.sampler.generate_batch): `dense` with eviction policy "dense" (every key kept), `compressed`
with the eviction the rollout samples with (`params.rollout.eviction`; `evaluate.compressed_eviction` when set, e.g.
to score a densely trained arm under the others' compression). So the compressed score is the
accuracy of the policy as RL actually runs it, and dense - compressed is what the compression costs.
Each response is scored with the task's metric (schemas.rewards: `score` and `exact_match`).

Writes, atomically as one directory (docs/design.md §5):
  predictions.arrow   one row per (prompt, mode) (schemas.tables EVAL_PREDICTIONS_SCHEMA)
  metrics.json        headline (an uncached DVC out): eval/{dense,compressed}/{score,exact_match}
  details.json        every figure of both modes (KV kept, lengths, tokens/s), agreement, score gap, and the
                      config (schemas.metrics)
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from schemas import rewards
from schemas.errors import SmdInputError
from schemas.layout import PREDICTIONS
from schemas.metrics import write_metrics
from schemas.params import EvictionParams, Params
from schemas.tables import read_table, write_table
from stages.common.distributed import agree, attempt, my_batches, worker_context, write_collectively
from stages.common.kvcache.sampler import generate_batch
from stages.common.model import (
    check_positions,
    load_policy,
    load_tokenizer,
    observation_window_tail,
    reference_nll_batch,
)
from stages.common.scoring import Scoring, term_means
from stages.common.vllm_sampler import VllmEngine

MODES = ("dense", "compressed")
# The stage's headline (metrics.json; progress rows and artifacts/metrics.json take theirs from it); the KV kept
# fraction is the rollout's headline.
HEADLINE = ("eval/dense/score", "eval/compressed/score", "eval/dense/exact_match", "eval/compressed/exact_match",
            "eval/dense/reference_nll")
DENSE = EvictionParams(policy="dense")


def eviction_for(mode: str, params: Params) -> EvictionParams:
    """The KV-cache compression of an evaluation mode."""
    if mode == "dense":
        return DENSE
    if mode == "compressed":  # applied, also when the rollout only simulates it (rollout.eviction.apply false)
        eviction = params.evaluate.compressed_eviction or params.rollout.eviction
        return eviction.model_copy(update={"apply": True})
    raise ValueError(f"unknown evaluation mode {mode!r}; choose one of {', '.join(MODES)}")


def length_batches(prompts: list[dict[str, Any]], batch_size: int) -> list[list[int]]:
    """Prompt indices in batches of `batch_size`, prompts of similar length together (shortest first)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]["prompt_token_ids"]))
    return [order[s: s + batch_size] for s in range(0, len(order), batch_size)]


def _decode_mode(model, tokenizer, prompts, batches: list[list[int]], eviction: EvictionParams, params: Params,
                 iteration: int, mode: str, advance, scoring: Scoring,
                 engine: VllmEngine | None = None) -> dict[int, dict[str, Any]]:
    """Greedy responses of one mode for the prompts of `batches`: {prompt index: prediction row}; on vLLM
    when `engine` is given (the dense mode with `evaluate.engine: vllm`: every prompt in one call, vLLM keeps
    `batch_size` decoding and refills the batch as they finish), else on smd's engine batch by batch. Each
    batch is submitted to `scoring` once decoded (a reward pool scores it while the next one decodes)."""
    cfg = params.evaluate
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    window_tail = observation_window_tail(eviction, tokenizer)  # the prompts were checked by `_inputs`
    rows: dict[int, dict[str, Any]] = {}
    pending: list[tuple[list[int], Any]] = []
    for batch in (batches if engine is None else [[i for b in batches for i in b]]):
        ids = [list(prompts[i]["prompt_token_ids"]) for i in batch]
        if engine is None:
            results, _ = generate_batch(model, ids, eviction, cfg.max_new_tokens, eos, pad, temperature=0.0,
                                        window_tail=window_tail,
                                        prefill_chunk_tokens=params.rollout.prefill_chunk_tokens)
        else:
            results = engine.generate(ids, cfg.max_new_tokens, eos, temperature=0.0)
        texts = []
        for i, res in zip(batch, results):
            p = prompts[i]
            text = tokenizer.decode([t for t in res.response_ids if t != eos], skip_special_tokens=True)
            texts.append(text)
            rows[i] = {
                "prompt_id": p["prompt_id"],
                "task": p["task"],
                "mode": mode,
                "response_text": text,
                "kv_peak_tokens": res.kv_peak_tokens,
                "kv_dense_tokens": res.kv_dense_tokens,
                "iteration": iteration,
                "reference": p["reference"],
                "response_token_ids": res.response_ids,
                "finish_reason": res.finish_reason,
            }
        pending.append((batch, scoring.submit([prompts[i] for i in batch], texts,
                                              [res.response_ids for res in results])))
        advance(len(batch))
    for batch, handle in pending:
        scored = scoring.result(handle)
        for k, i in enumerate(batch):
            rows[i]["score"] = scored.rewards[k]
            rows[i]["exact_match"] = scored.exact_match[k]
            if scored.terms is not None:  # (reward_extras on every row: the table's columns follow its first row)
                rows[i]["reward_terms"] = scored.terms[k]
                rows[i]["reward_extras"] = scored.extras[k] if scored.extras is not None else None
    return rows


def _mode_metrics(rows: list[dict[str, Any]], mode: str, seconds: float) -> dict[str, float]:
    peak = np.array([r["kv_peak_tokens"] for r in rows], dtype=np.float64)
    dense = np.array([r["kv_dense_tokens"] for r in rows], dtype=np.float64)
    tokens = sum(len(r["response_token_ids"]) for r in rows)
    return {
        f"eval/{mode}/score": float(np.mean([r["score"] for r in rows])),
        f"eval/{mode}/exact_match": float(np.mean([r["exact_match"] for r in rows])),
        f"eval/{mode}/kv_kept_fraction": float(peak.sum() / dense.sum()),
        f"eval/{mode}/kv_peak_tokens_mean": float(peak.mean()),
        f"eval/{mode}/response_length_mean": float(tokens / len(rows)),
        f"eval/{mode}/tokens_per_s": float(tokens / max(seconds, 1e-9)),
    }


def summary_table(metrics: dict[str, Any]) -> Table:
    """Dense vs compressed side by side (printed at the end of `smdctl evaluate`)."""
    cfg = metrics.get("config", {})
    ev = cfg.get("compressed_eviction") or cfg.get("rollout", {}).get("eviction", {})
    table = Table(title=f"evaluate iteration {metrics['iteration']}: {metrics['eval/prompts']} prompts, "
                        f"metric {metrics['metric']}")
    table.add_column("mode")
    table.add_column("KV cache")
    table.add_column("score", justify="right")
    table.add_column("exact match", justify="right")
    table.add_column("KV kept", justify="right")
    for mode in MODES:
        cache = "full" if mode == "dense" else f"{ev.get('policy')} keep_ratio={ev.get('keep_ratio')}"
        table.add_row(mode, cache, f"{metrics[f'eval/{mode}/score']:.4f}",
                      f"{metrics[f'eval/{mode}/exact_match']:.4f}", f"{metrics[f'eval/{mode}/kv_kept_fraction']:.3f}")
    return table


def run_evaluate(params: Params, iteration: int, policy_path: str | Path, eval_prompts_path: str | Path,
             out_dir: str | Path, show_progress: bool = True) -> dict[str, Path]:
    """Greedy-evaluate `policy_path` on the eval split with the dense and the compressed cache.

    Returns {"predictions", "metrics", "details"}: out_dir/predictions.arrow, metrics.json, details.json. Bad input (missing
    checkpoint, missing/empty/invalid eval table, prompts too long for the model) raises SmdInputError before
    anything is written; the output directory appears only complete.

    Data parallel under the launcher (stages.common.distributed): decoding batch b (prompts sorted by length) and
    reference-NLL batch b run on process b mod N; the predictions and NLL terms are gathered to rank 0 over
    the process group and assembled in table order, so the output equals the one-process output (greedy
    decoding has no randomness). A failing process fails the stage on every process; nothing is written.
    """
    cfg = params.evaluate
    eval_prompts_path, out_dir = Path(eval_prompts_path), Path(out_dir)
    ctx = worker_context(params.model.device)  # model.device for this local rank (gloo on CPU, NCCL on CUDA)
    inputs, error = attempt(lambda: _inputs(params, policy_path, eval_prompts_path, ctx.device))
    agree(ctx, None, error)  # bad input: one line from rank 0 (every process reads the same files)
    prompts, model, tokenizer = inputs
    decode_batches = length_batches(prompts, cfg.batch_size)
    nll_batches = [list(range(s, min(s + cfg.batch_size, len(prompts)))) for s in range(0, len(prompts), cfg.batch_size)]
    mine, mine_nll = my_batches(len(decode_batches), ctx), my_batches(len(nll_batches), ctx)

    def my_part(tmp: Path) -> dict[str, Any]:
        """Decode this process's batches in both modes, score its reference-NLL batches."""
        part: dict[str, Any] = {"rows": {}, "seconds": {}, "nll": {}}
        progress = Progress(TextColumn("evaluate {task.fields[mode]}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), disable=not (show_progress and ctx.is_main), transient=False,
                            console=Console(stderr=True))
        # vLLM decodes the dense mode only (it has no per-head eviction); built once, before the clock starts.
        with vllm_engine(params, policy_path, prompts) if cfg.engine == "vllm" else nullcontext() as engine, progress:
            bar = progress.add_task("evaluate", total=len(MODES) * sum(len(decode_batches[b]) for b in mine), mode="")
            for mode in MODES:
                progress.update(bar, mode=mode)
                t0 = time.perf_counter()
                part["rows"][mode] = _decode_mode(model, tokenizer, prompts, [decode_batches[b] for b in mine],
                                                  eviction_for(mode, params), params, iteration, mode,
                                                  lambda n: progress.update(bar, advance=n), scoring,
                                                  engine if mode == "dense" else None)
                part["seconds"][mode] = time.perf_counter() - t0
        for b in mine_nll:
            part["nll"][b] = reference_nll_batch(model, tokenizer, [prompts[i]["prompt_token_ids"] for i in nll_batches[b]],
                                                 [prompts[i]["reference"] for i in nll_batches[b]])
        return part

    config = {
        "iteration": iteration,
        "policy": str(policy_path),
        "eval_prompts": str(eval_prompts_path),
        "seed": params.seed,
        "evaluate": cfg.model_dump(),
        "rollout": {"eviction": params.rollout.eviction.model_dump()},
        "compressed_eviction": eviction_for("compressed", params).model_dump(),  # what the compressed mode ran
        "learner": {"objective": params.learner.objective, "kl_lambda": params.learner.kl_lambda},
    }
    metrics: dict[str, Any] = {}

    def merge(tmp: Path, parts: list[dict[str, Any]]) -> None:
        """Rank 0: predictions in table order (dense rows, then compressed), metrics of both modes."""
        rows: list[dict[str, Any]] = []
        for mode in MODES:
            by_index = {i: row for part in parts for i, row in part["rows"][mode].items()}
            mode_rows = [by_index[i] for i in range(len(prompts))]
            # Wall time of the parallel phase: the slowest process's.
            seconds = max(part["seconds"][mode] for part in parts)
            metrics.update(_mode_metrics(mode_rows, mode, seconds))
            metrics[f"eval/{mode}/seconds"] = float(seconds)
            rows.extend(mode_rows)
        nll = {b: terms for part in parts for b, terms in part["nll"].items()}
        total = 0.0
        for b in range(len(nll_batches)):  # the one-process summation order (stages.common.model.reference_nll)
            for term in nll[b]:
                total += term
        metrics["eval/dense/reference_nll"] = total / max(len(prompts), 1)
        dense_rows, comp_rows = rows[: len(prompts)], rows[len(prompts):]
        tasks = sorted({p["task"] for p in prompts})
        metrics.update({
            "iteration": iteration,
            "task": ",".join(tasks),
            "metric": ",".join(sorted({scoring.metric_name(t) for t in tasks})),
            "eval/prompts": len(prompts),
            "eval/processes": ctx.world,
            "eval/agreement": float(np.mean([d["response_token_ids"] == c["response_token_ids"]
                                             for d, c in zip(dense_rows, comp_rows)])),
            "eval/score_gap": metrics["eval/dense/score"] - metrics["eval/compressed/score"],
            "config": config,
        })
        if scoring.scorer is not None:  # each reward function's mean per mode, as TRL logs `rewards/<name>/mean`
            for mode, mode_rows in (("dense", dense_rows), ("compressed", comp_rows)):
                means = term_means([r["reward_terms"] for r in mode_rows], [r.get("reward_extras") for r in mode_rows])
                metrics.update({f"eval/{mode}/{k}": v for k, v in means.items()})
        write_table(rows, tmp / PREDICTIONS, "eval_predictions", config)
        write_metrics(tmp / "metrics.json", metrics, HEADLINE)

    with Scoring(params.reward, params.prepare.prompt_key) as scoring:
        config.update(scoring.record())
        write_collectively(out_dir, ctx, my_part, merge)
    if show_progress and ctx.is_main:
        Console(stderr=True).print(summary_table(metrics))
    return {"predictions": out_dir / PREDICTIONS, "metrics": out_dir / "metrics.json",
            "details": out_dir / "details.json"}


def vllm_engine(params: Params, policy_path: str | Path, prompts: list[dict[str, Any]]) -> VllmEngine:
    """The stage's vLLM engine for the dense mode (`evaluate.engine: vllm`): room for the longest prompt and
    its response, `evaluate.batch_size` sequences decoded together."""
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    return VllmEngine(policy_path, params.model.dtype, longest + params.evaluate.max_new_tokens,
                      params.evaluate.batch_size, params.seed)


def _inputs(params: Params, policy_path: str | Path, eval_prompts_path: Path, device: torch.device | str = "cpu"):
    """(prompts, model, tokenizer) after checking the prompts' tasks and lengths."""
    cfg = params.evaluate
    prompts = read_table(eval_prompts_path, "prompts").to_pylist()
    if cfg.num_prompts:
        prompts = prompts[: cfg.num_prompts]
    for p in prompts:  # unknown task, or one with no built-in scorer -> one line naming it, before any decoding
        rewards.metric_name(p["task"])
        if not params.reward.function and rewards.metric_name(p["task"]) == "reward_function":
            raise SmdInputError(f"{eval_prompts_path}: task: {p['task']!r} has no built-in scorer; set reward.function")
    model = load_policy(policy_path, params.model.dtype, device=device)
    tokenizer = load_tokenizer(policy_path)
    longest = max(prompts, key=lambda p: len(p["prompt_token_ids"]))
    n = len(longest["prompt_token_ids"])
    check_positions(model.config, n + cfg.max_new_tokens,
                    f"{eval_prompts_path}: prompt_token_ids: prompt {longest['prompt_id']} has {n} tokens; with "
                    f"evaluate.max_new_tokens={cfg.max_new_tokens} it")
    field = ("evaluate.compressed_eviction" if cfg.compressed_eviction is not None else "rollout.eviction")
    observation_window_tail(eviction_for("compressed", params), tokenizer, [p["prompt_token_ids"] for p in prompts],
                            eval_prompts_path, f"{field}.window_anchor")
    return prompts, model, tokenizer
