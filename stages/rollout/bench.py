"""`smdctl bench rollout`: dense vs every eviction policy, side by side in one process.

Per prompt length and policy: generated tokens/s relative to dense, retained KV-cache bytes relative to
dense (the physical slot tensors), and the process peak resident memory while that configuration ran
(VmHWM, reset before each run through /proc/self/clear_refs).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from schemas.params.model import TinyModelParams
from schemas.params.rollout import POLICIES, EvictionParams
from stages.kvcache.engine import generate_batch
from stages.model import build_tiny_model, place_model, resolve_device


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_rollout(lengths=(512, 2048, 4096), keep_ratio: float = 0.5, batch_size: int = 4, new_tokens: int = 128,
                  repeats: int = 1, print_fn=print, device: str = "auto") -> list[dict]:
    torch.manual_seed(0)
    # the one device rule (model.device): the engine runs where the model is
    model = place_model(build_tiny_model(TinyModelParams(), vocab_size=256).eval(), resolve_device(device))
    rows = []
    print_fn(f"{'T':>5} {'policy':>7} {'tok/s':>8} {'x dense':>8} {'KV MiB':>8} {'KV/dense':>8} {'peak RSS MiB':>12}")
    for T in lengths:
        g = torch.Generator(device="cpu").manual_seed(T)
        prompts = [torch.randint(4, 256, (T,), generator=g, device="cpu").tolist() for _ in range(batch_size)]
        dense_rate = dense_bytes = None
        for policy in POLICIES:
            ev = EvictionParams(policy=policy, keep_ratio=keep_ratio)
            best = None
            for _ in range(repeats):
                _reset_peak_rss()
                t0 = time.perf_counter()
                res, stats = generate_batch(model, prompts, ev, new_tokens, eos_token_id=None,
                                            generator=torch.Generator().manual_seed(0))
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            rate = stats.generated_tokens / best
            if policy == "dense":
                dense_rate, dense_bytes = rate, stats.cache_bytes
            row = {"T": T, "policy": policy, "tokens_per_s": rate, "speed_vs_dense": rate / dense_rate,
                   "kv_bytes": stats.cache_bytes, "kv_vs_dense": stats.cache_bytes / dense_bytes,
                   "peak_rss_mib": _peak_rss_mib()}
            rows.append(row)
            print_fn(f"{T:>5} {policy:>7} {rate:>8.1f} {row['speed_vs_dense']:>8.2f} "
                     f"{stats.cache_bytes / 2**20:>8.2f} {row['kv_vs_dense']:>8.3f} {row['peak_rss_mib']:>12.0f}")
    return rows
