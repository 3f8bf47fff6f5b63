"""`smdctl bench rollout`: transformers `generate` (dense) as the anchor, smd's engine dense and under every
eviction policy, side by side in one process.

Shapes: `default` is the default rollout (64 sequences of ~110 prompt tokens, 100 to 120 so batches are
left-padded, 16 new tokens, 16 sequences decoded together, as `rollout.batch_size`); a number T is `batch_size`
sequences of T prompt tokens and `new_tokens` new tokens. Per shape and engine: generated tokens/s, the ratio
to `generate` and to smd's dense engine, retained KV-cache bytes relative to dense (the physical slot tensors),
and the process peak resident memory while that configuration ran (VmHWM, reset before each run through
/proc/self/clear_refs; on a GPU, torch.cuda.max_memory_allocated). Runs are interleaved over `repeats`
rounds and the fastest counts, so a noisy neighbour slows every column alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from schemas.errors import SmdInputError
from schemas.params.model import TinyModelParams
from schemas.params.rollout import POLICIES, EvictionParams
from stages.common.kvcache.sampler import generate_batch
from stages.common.model import build_tiny_model, place_model, resolve_device

DEFAULT_SHAPE = "default"
VOCAB = 256


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass(frozen=True)
class BenchShape:
    """Prompts of one bench shape, decoded `batch_size` at a time, `new_tokens` each."""

    name: str
    prompts: list[list[int]]
    batch_size: int
    new_tokens: int


def bench_shapes(shapes: list[str], batch_size: int, new_tokens: int) -> list[BenchShape]:
    """`default` (the default rollout) or a prompt length per entry (see the module docstring)."""
    out = []
    for name in shapes:
        if name == DEFAULT_SHAPE:
            g = torch.Generator(device="cpu").manual_seed(110)
            lens = torch.randint(100, 121, (64,), generator=g, device="cpu").tolist()
            prompts = [torch.randint(4, VOCAB, (n,), generator=g, device="cpu").tolist() for n in lens]
            out.append(BenchShape("default", prompts, 16, 16))
        else:
            if not name.isdigit() or int(name) < 1:
                raise SmdInputError(f"--lengths: {name!r} is neither `{DEFAULT_SHAPE}` nor a prompt length")
            T = int(name)
            g = torch.Generator(device="cpu").manual_seed(T)
            prompts = [torch.randint(4, VOCAB, (T,), generator=g, device="cpu").tolist() for _ in range(batch_size)]
            out.append(BenchShape(str(T), prompts, batch_size, new_tokens))
    return out


def hf_generate(model, prompts: list[list[int]], new_tokens: int, batch_size: int) -> int:
    """transformers `generate` (dense DynamicCache, the model's own attention), sampling at temperature 1 with
    top-k/top-p off, exactly `new_tokens` per sequence (as smd's engine without EOS); returns tokens made."""
    device = next(model.parameters()).device
    made = 0
    for s in range(0, len(prompts), batch_size):
        batch = prompts[s: s + batch_size]
        P = max(map(len, batch))
        ids = torch.zeros((len(batch), P), dtype=torch.long, device="cpu")
        mask = torch.zeros((len(batch), P), dtype=torch.long, device="cpu")
        for i, p in enumerate(batch):  # left padding, as smd's engine pads
            ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long, device="cpu")
            mask[i, P - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
        made += (out.shape[1] - P) * len(batch)
    return made


def smd_generate(model, prompts: list[list[int]], eviction: EvictionParams, new_tokens: int, batch_size: int,
                 compile: bool = False) -> tuple[int, int, int]:
    """smd's engine batch by batch (as the rollout stage runs it): (tokens made, largest KV bytes of a batch,
    its dense counterpart)."""
    made = kv = dense = 0
    for s in range(0, len(prompts), batch_size):
        _, stats = generate_batch(model, prompts[s: s + batch_size], eviction, new_tokens, eos_token_id=None,
                                  generator=torch.Generator(device="cpu").manual_seed(s), compile=compile)
        made += stats.generated_tokens
        kv, dense = max(kv, stats.cache_bytes), max(dense, stats.dense_cache_bytes)
    return made, kv, dense


def bench_rollout(shapes: list[str] | None = None, keep_ratio: float = 0.5, batch_size: int = 4,
                  new_tokens: int = 128, repeats: int = 3, print_fn=print, device: str = "auto",
                  compile: bool = False) -> list[dict]:
    """Print one table (see the module docstring) and return its rows."""
    torch.manual_seed(0)
    # the one device rule (model.device): the engine runs where the model is
    dev = resolve_device(device)
    model = place_model(build_tiny_model(TinyModelParams(), vocab_size=VOCAB).eval(), dev)
    engines = ["generate", *POLICIES]
    rows = []
    print_fn(f"{torch.get_num_threads()} torch threads on {dev}, keep ratio {keep_ratio}, fastest of {repeats} "
             f"interleaved rounds{', smd decode step compiled' if compile else ''}")
    print_fn(f"{'shape':>18} {'engine':>8} {'tok/s':>9} {'x generate':>10} {'x dense':>8} {'KV/dense':>8} "
             f"{'peak MiB':>9}")
    for shape in bench_shapes(shapes or [DEFAULT_SHAPE, "2048", "4096"], batch_size, new_tokens):
        best: dict[str, float] = {}
        made: dict[str, int] = {}
        kv: dict[str, float] = {}
        peak: dict[str, float] = {}
        for _ in range(repeats):
            for engine in engines:
                _reset_peak(dev)
                t0 = time.perf_counter()
                if engine == "generate":
                    made[engine] = hf_generate(model, shape.prompts, shape.new_tokens, shape.batch_size)
                    kv[engine] = 1.0
                else:
                    ev = EvictionParams(policy=engine, keep_ratio=keep_ratio)
                    made[engine], kv_bytes, dense_bytes = smd_generate(model, shape.prompts, ev, shape.new_tokens,
                                                                       shape.batch_size, compile)
                    kv[engine] = kv_bytes / dense_bytes
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                dt = time.perf_counter() - t0
                best[engine] = min(best.get(engine, dt), dt)
                peak[engine] = max(peak.get(engine, 0.0), _peak_mib(dev))
        rate = {e: made[e] / best[e] for e in engines}
        avg_prompt = sum(map(len, shape.prompts)) // len(shape.prompts)
        label = f"{len(shape.prompts)}x{avg_prompt}+{shape.new_tokens}"
        for engine in engines:
            row = {"shape": shape.name, "engine": engine, "sequences": len(shape.prompts), "prompt_tokens": avg_prompt,
                   "new_tokens": shape.new_tokens, "tokens_per_s": rate[engine],
                   "vs_generate": rate[engine] / rate["generate"], "vs_dense": rate[engine] / rate["dense"],
                   "kv_vs_dense": kv[engine], "peak_mib": peak[engine]}
            rows.append(row)
            print_fn(f"{label:>18} {engine:>8} {rate[engine]:>9.1f} {row['vs_generate']:>10.2f} "
                     f"{row['vs_dense']:>8.2f} {kv[engine]:>8.3f} {peak[engine]:>9.0f}")
    return rows
