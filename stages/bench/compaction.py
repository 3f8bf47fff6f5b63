"""`smdctl bench compaction`: compacted size, compaction throughput and micro-batch read time.

For synthetic rollouts (4 layers x 2 KV heads like the tiny model, keep ratio 0.5) at each length T and
policy, measured side by side in one run (the machine is shared and noisy; ratios are what count):

  - compacted bytes relative to a dense per-head bitmask (T^2/8 bytes per layer/head per row) and to
    raw int32 evict_at (4 bytes per token per layer/head);
  - compaction throughput (tokens/s, validation included);
  - time to read one learner micro-batch's masks (`read_mask_rows` of chunk_rows rows, store open)
    against a learner-like step on the same rows: forward+backward of the tiny Qwen3 model
    (`stages.common.model.build_tiny_model`, SDPA, dense causal attention: a lower bound of the shadow-masked
    step, so the ratio is conservative); from `fwd_only_from` tokens on (16k by default) only the
    attention forward of the tiny shape (one causal SDPA call per layer over T tokens, GQA), an even
    lower bound, to keep the run within a few minutes on a CPU.

A micro-batch holds `microbatch_tokens // T` rows (at least 1); each rollout has two micro-batches.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schemas.compacted_masks import open_mask_store, read_mask_rows
from schemas.layout import MASKS
from schemas.params.compaction import CompactionParams
from schemas.params.rollout import POLICIES
from stages.bench.synthetic_rollouts import eviction_config, synthetic_rollout, write_synthetic_inputs
from stages.compaction.compact import run_compaction

TARGET_DENSE_FRACTION = 0.01  # at T = 4096
TARGET_READ_FRACTION = 0.05


def _learner_step(T: int, rows: int, mode: str, repeats: int = 1) -> float:
    """Median seconds of a learner-like step of the tiny model on [rows, T] tokens."""
    import torch

    from schemas.params.model import TinyModelParams
    from stages.common.model import build_tiny_model
    from stages.common.vocab import tiny_vocabulary

    shape = TinyModelParams().model_copy(update={"max_position_embeddings": max(T, 8192)})
    model = build_tiny_model(shape, vocab_size=len(tiny_vocabulary()), seed=0)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(4, len(tiny_vocabulary()), (rows, T))

    def step() -> None:
        if mode == "sdpa-fwd":
            cfg = model.config
            g = cfg.num_attention_heads // cfg.num_key_value_heads
            for _ in range(cfg.num_hidden_layers):
                q = torch.randn(rows, cfg.num_attention_heads, T, cfg.head_dim)
                kv = torch.randn(rows, cfg.num_key_value_heads, T, cfg.head_dim).repeat_interleave(g, 1)
                torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        elif mode == "fwd":
            with torch.no_grad():
                model(input_ids=ids)
        else:
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()

    small = torch.randint(4, 200, (1, 64))
    with torch.no_grad():
        model(input_ids=small)  # warm the kernels without paying a full step
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _read_time(store_path: Path, rows: Sequence[int], repeats: int) -> float:
    store = open_mask_store(store_path)
    read_mask_rows(store, rows)  # warm (the learner keeps the store open)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        read_mask_rows(store_path, rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_compaction_bench(
    lengths: Sequence[int] = (1024, 4096, 16384),
    policies: Sequence[str] = POLICIES,
    *,
    num_layers: int = 4,
    num_kv_heads: int = 2,
    keep_ratio: float = 0.5,
    microbatch_tokens: int = 4096,
    fwd_only_from: int = 16384,
    read_repeats: int = 7,
    seed: int = 0,
    console: Any = None,
    json_out: Path | None = None,
) -> list[dict[str, Any]]:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=180)
    for p in policies:
        if p not in POLICIES:
            from schemas.errors import SmdInputError

            raise SmdInputError(f"bench compaction: unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="smd-bench-compaction-") as tmp:
        for T in lengths:
            mb = max(1, microbatch_tokens // T)
            rows = 2 * mb
            P = max(1, T // 4)
            mode = "sdpa-fwd" if T >= fwd_only_from else "fwd+bwd"
            console.print(f"[dim]T={T}: learner-like step ({mode}) on {mb} x {T} tokens ...[/dim]")
            step_s = _learner_step(T, mb, mode)
            for policy in policies:
                ev = eviction_config(policy, keep_ratio)
                table, shards, _, ev = synthetic_rollout(
                    policy, [T] * rows, [P] * rows, num_layers=num_layers, num_kv_heads=num_kv_heads,
                    eviction=ev, seed=seed, num_shards=2,
                )
                d = Path(tmp) / f"{policy}-{T}"
                traj, raw = write_synthetic_inputs(d, table, shards, ev, num_layers, num_kv_heads)
                t0 = time.perf_counter()
                out = run_compaction(CompactionParams(chunk_rows=mb), traj, raw, d / MASKS, d / "metrics.json")
                compact_s = time.perf_counter() - t0
                m = json.loads(out["details"].read_text())
                read_s = _read_time(out["masks"], list(range(mb)), read_repeats)
                results.append(
                    {
                        "T": T,
                        "policy": policy,
                        "rows": rows,
                        "microbatch_rows": mb,
                        "unique_columns": m["unique_columns"],
                        "dtype": m["evict_at_dtype"],
                        "bytes": m["bytes"]["compacted"],
                        "vs_dense_bitmask": m["ratio_vs_dense_bitmask"],
                        "vs_raw_int32": m["ratio_vs_raw_int32"],
                        "compact_tokens_per_s": rows * T / compact_s,
                        "read_s": read_s,
                        "learner_step_s": step_s,
                        "learner_mode": mode,
                        "read_vs_step": read_s / step_s,
                    }
                )
    title = f"bench compaction ({num_layers} layers x {num_kv_heads} kv heads, keep ratio {keep_ratio:.2f})"
    t = Table(title=title, title_justify="left")
    for c in ("T", "policy", "rows", "uniq cols", "dtype", "bytes", "% dense bits", "% raw int32",
              "compact tok/s", "read ms (mb)", "step ms", "read/step"):
        t.add_column(c, justify="right")
    for r in results:
        t.add_row(
            str(r["T"]), r["policy"], f"{r['rows']} ({r['microbatch_rows']}/mb)", str(r["unique_columns"]), r["dtype"],
            f"{r['bytes']:,}", f"{100 * r['vs_dense_bitmask']:.3f}%", f"{100 * r['vs_raw_int32']:.2f}%",
            f"{r['compact_tokens_per_s']:,.0f}", f"{1e3 * r['read_s']:.2f}",
            f"{1e3 * r['learner_step_s']:.0f} {r['learner_mode']}", f"{100 * r['read_vs_step']:.2f}%",
        )
    console.print(t)
    at4k = [r for r in results if r["T"] == 4096]
    if at4k:
        worst = max(at4k, key=lambda r: r["vs_dense_bitmask"])
        ok = worst["vs_dense_bitmask"] <= TARGET_DENSE_FRACTION
        console.print(
            f"target size <= 1% of dense bitmask at T=4096: worst {worst['policy']} "
            f"{100 * worst['vs_dense_bitmask']:.3f}% -> {'[green]PASS[/green]' if ok else '[red]FAIL[/red]'}"
        )
    if results:
        worst = max(results, key=lambda r: r["read_vs_step"])
        ok = worst["read_vs_step"] <= TARGET_READ_FRACTION
        console.print(
            f"target micro-batch read < 5% of a learner step: worst {worst['policy']} T={worst['T']} "
            f"{100 * worst['read_vs_step']:.2f}% -> {'[green]PASS[/green]' if ok else '[red]FAIL[/red]'}"
        )
    if json_out is not None:
        json_out.write_text(json.dumps(results, indent=2) + "\n")
    return results
