"""`smdctl bench rollout --model DIR --long`: the rollout at long context (issue 54), measured, not computed.

Per case (prompt tokens x new tokens) and engine, one run in a fresh process of its own (so one engine's
allocations never count in another's peak): tokens/s, decode tokens/s, and the **measured peak memory per
sequence**: the process's peak over the timed run (VmHWM, reset after an untimed warm-up; on a GPU,
`torch.cuda.max_memory_allocated`) minus what it held with the model loaded and warmed up, over the batch. Then,
per engine, **the largest batch that fits a memory budget, found by running it**: batches double from 1 while a
run's measured peak beyond the model stays within the budget, then a bisection between the last batch that fit
and the first that did not; every probe is a whole run of the case.

Beside each engine, its floors (docs/design.md §4b; `stages.bench.floors`): **KV/seq**, the KV cache the engine
holds per sequence at its last step (smd: its slot cache's physical bytes, shared prompts once a group; generate:
every sample's dense cache; vLLM: the cache it allocated for the batch), with `peak/KV` the measured peak over it
(what the transients add); and **floor tok/s**, the decoding tokens/s at which a step would only read the weights
and the KV it attends over once at the device's bandwidth (a GPU's data sheet; on the CPU measured on the bench's
threads), with `of floor` the measured decode tokens/s over it.

Engines:
- `smd-dense`: smd's engine with the dense policy (the shadow-mask engine's own dense path);
- `smd-snapkv`: SnapKV at `--keep-ratio`, evicting after every decoding step (the paper's rule, `interval` 1);
- `smd-snapkv-k`: SnapKV with `rollout.eviction.interval` = `--interval` (evict every k steps down to the budget);
- `generate`: transformers `generate`, dense, the model's own attention (the field's anchor);
- `vllm`: vLLM dense, as users run it (its CPU build here), its KV cache sized for exactly the batch.
The smd engines prefill in chunks of `--prefill-chunk-tokens` (rollout.prefill_chunk_tokens; 0 = one forward).
Same threads for every engine (`--threads`, each worker `torch.set_num_threads`), pinned to the caller's CPU
affinity; random prompts (seeded by length), temperature 1, EOS ignored, exactly `new` tokens per sequence.

`--group-size G` (> 1): the GRPO workload: batch / G distinct prompts, each repeated for its G samples, adjacent
in the batch as the rollout stage orders them. smd's engines share each prompt (`rollout.share_prompt`, on as in
the stage): the prompt's prefill and its kept keys once per group. `generate` expands every sample's prompt, as
transformers' `num_return_sequences` does. vLLM is left out: its KV cache is allocated up front for the batch
(`kv_cache_memory_bytes`), so its peak per sequence would be that sizing, not what a group holds (the prefix
cache's blocks per group are counted by `bench rollout --group-size`). The largest-batch search steps in groups.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from schemas.errors import SmdInputError

LONG_CASES: tuple[tuple[int, int], ...] = ((2048, 512), (4096, 1024), (6144, 2048), (1024, 4096))
LONG_ENGINES: tuple[str, ...] = ("smd-dense", "smd-snapkv", "smd-snapkv-k", "generate", "vllm")
WARMUP_PROMPT, WARMUP_NEW = 32, 4


def parse_cases(text: str | None) -> list[tuple[int, int]]:
    """`--cases 2048x512,4096x1024` -> [(2048, 512), (4096, 1024)]; None: `LONG_CASES`."""
    if not text:
        return list(LONG_CASES)
    cases = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        p, _, n = part.partition("x")
        if not (p.isdigit() and n.isdigit() and int(p) > 0 and int(n) > 0):
            raise SmdInputError(f"--cases: {part!r} is not PROMPTxNEW (e.g. 4096x1024)")
        cases.append((int(p), int(n)))
    return cases


def _held_mib(device) -> float:
    """What the process holds now: allocated CUDA memory on a GPU, else the resident set."""
    import torch

    from stages.bench.rollout import _rss_mib

    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else _rss_mib()


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine, one case, one batch, in this process: an untimed warm-up, then the timed run (see the module
    docstring). Returns tokens, seconds, prefill seconds (a 1-token run after it), held and peak MiB."""
    import torch

    from schemas.params.rollout import EvictionParams
    from stages.bench.floors import dense_kv_read_bytes, hbm_bandwidth, measured_read_bandwidth
    from stages.bench.rollout import _peak_mib, _reset_peak, hf_generate, kv_bytes_per_token
    from stages.common.kvcache.sampler import generate_batch
    from stages.common.model import load_policy, place_model, resolve_device

    torch.set_num_threads(int(spec["threads"]))
    device = resolve_device(spec.get("device", "auto"))
    if spec["engine"] == "bandwidth":  # the speed floor's bandwidth, on the bench's threads and device
        return {"bandwidth": hbm_bandwidth(device) if device.type == "cuda" else measured_read_bandwidth()}
    engine, B, P, N = spec["engine"], int(spec["batch"]), int(spec["prompt"]), int(spec["new"])
    G = int(spec.get("group_size", 1))
    g = torch.Generator(device="cpu").manual_seed(P)
    model_dir = Path(spec["model"])
    kv: dict[str, float] = {}  # the timed run's KV cache bytes: held, and read by a decoding step on average

    if engine == "vllm":
        from stages.common import vllm_sampler

        held_before = _held_mib(device)
        # vLLM counts prompt plus output tokens against max_model_len: P + N, which a model's last position allows
        llm = vllm_sampler.VllmEngine(model_dir, spec.get("dtype", "float32"), P + N, B)
        weights = _weights_mib(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        vocab = cfg["vocab_size"]
        weight_bytes = weights * 2**20
        per_token = kv_bytes_per_token(SimpleNamespace(**cfg), 4)

        def run(prompts, new):
            llm.llm.reset_prefix_cache()
            out = llm.generate(prompts, new, None, 1.0, list(range(len(prompts))))
            # the cache vLLM allocated for the batch; its steps read each sequence's own blocks
            kv["held"] = vllm_sampler.kv_cache_bytes(cfg, 4, P + new, len(prompts))
            kv["read"] = dense_kv_read_bytes(per_token, len(prompts), P, new)
            return sum(len(r.response_ids) for r in out)
        held = held_before + weights  # the model only: vLLM's cache, sized for the batch, counts as the run's
    else:
        model = place_model(load_policy(model_dir, spec.get("dtype", "float32")).eval(), device)
        vocab = model.config.vocab_size
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

        if engine == "generate":
            per_token = kv_bytes_per_token(model.config, next(model.parameters()).element_size())

            def run(prompts, new):
                # every sample its own dense cache (the prompt expanded), read whole by every step
                kv["held"] = per_token * len(prompts) * (P + new)
                kv["read"] = dense_kv_read_bytes(per_token, len(prompts), P, new)
                return hf_generate(model, prompts, new, len(prompts))
        else:
            policy = "dense" if engine == "smd-dense" else "snapkv"
            interval = int(spec["interval"]) if engine == "smd-snapkv-k" else 1
            ev = EvictionParams(policy=policy, keep_ratio=float(spec["keep_ratio"]), interval=interval)

            def run(prompts, new):
                _, stats = generate_batch(model, prompts, ev, new, eos_token_id=None,
                                          generator=torch.Generator(device="cpu").manual_seed(0),
                                          prefill_chunk_tokens=int(spec["prefill_chunk_tokens"]))
                # the slot cache's physical bytes (shared prompts once a group): held, and read by every step
                kv["held"] = kv["read"] = stats.cache_bytes
                return stats.generated_tokens
        run([torch.randint(4, vocab, (WARMUP_PROMPT,), generator=g).tolist()], WARMUP_NEW)  # untimed warm-up
        held = _held_mib(device)
    # a group's G samples of one prompt, adjacent (G = 1: every sequence its own prompt)
    prompts = [p for p in (torch.randint(4, vocab, (P,), generator=g).tolist() for _ in range(B // G))
               for _ in range(G)]
    _reset_peak(device)
    t0 = time.perf_counter()
    made = run(prompts, N)
    seconds = time.perf_counter() - t0
    peak = _peak_mib(device)
    kv_held, kv_read = kv["held"], kv["read"]
    prefill_s = float("nan")
    if spec.get("prefill_run", True):
        t0 = time.perf_counter()
        run(prompts, 1)
        prefill_s = time.perf_counter() - t0
    return {"engine": engine, "batch": B, "prompt": P, "new": N, "tokens": made, "seconds": seconds,
            "prefill_s": prefill_s, "held_mib": held, "peak_mib": peak, "kv_mib": kv_held / 2**20,
            "kv_read_bytes": kv_read, "weight_bytes": weight_bytes}


def _weights_mib(model_dir: Path) -> float:
    """Bytes of the model's float32 weights, from its safetensors files' shapes (what vLLM loads)."""
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            total += sum(math.prod(fh.get_slice(name).get_shape()) for name in fh.keys()) * 4
    return total / 2**20


def run_isolated(spec: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any] | None:
    """`run_worker` in a fresh Python process; None when it died (out of memory) or ran past `timeout_s`."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]))
    try:
        proc = subprocess.run([sys.executable, "-m", "stages.bench.rollout_long", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout_s,
                              cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        return None
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None
    return json.loads(lines[-1])


def largest_batch_by_running(spec: dict[str, Any], budget_mib: float, max_batch: int = 256,
                             timeout_s: float | None = None) -> tuple[int, dict[str, Any] | None]:
    """The largest batch whose run stays within `budget_mib` beyond the model (measured peak - held), by doubling
    from one group (`spec["group_size"]` sequences, 1 by default) and then bisecting in whole groups; (0, None)
    when not even one group fits. Returns the batch (in sequences) and its run."""
    G = int(spec.get("group_size", 1))

    def fits(groups: int) -> dict[str, Any] | None:
        b = groups * G
        t0 = time.perf_counter()
        r = run_isolated({**spec, "batch": b, "prefill_run": False}, timeout_s)
        beyond = None if r is None else r["peak_mib"] - r["held_mib"]
        ok = beyond is not None and beyond <= budget_mib
        # every probe is a whole run (minutes at long context): each is said as it ends, so a stopped search
        # still reports what it measured
        said = (f"{beyond:.0f} MiB beyond the model, {'fits' if ok else 'over'}" if beyond is not None
                else "failed (out of memory or past the timeout)")
        print(f"# budget {budget_mib:.0f} MiB, {spec['prompt']}+{spec['new']} x {b} {spec['engine']}: {said} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        return r if ok else None

    max_groups = max_batch // G
    best_n, best = 0, None
    n = 1
    while n <= max_groups:
        r = fits(n)
        if r is None:
            break
        best_n, best = n, r
        n *= 2
    lo, hi = best_n, min(n, max_groups + 1)  # lo groups fit (or is 0), hi do not (or is past the cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = fits(mid)
        if r is None:
            hi = mid
        else:
            lo, best_n, best = mid, mid, r
    return best_n * G, best


def _ratio(row: dict, rows: dict[str, dict], anchor: str, key: str) -> float:
    """row[key] over the anchor engine's (nan when the anchor did not run or has 0)."""
    return row[key] / rows[anchor][key] if anchor in rows and rows[anchor][key] else float("nan")


def bench_rollout_long(model_dir: str | Path, cases: list[tuple[int, int]] | None = None, batch_size: int = 8,
                       keep_ratio: float = 0.5, interval: int = 64, prefill_chunk_tokens: int = 2048,
                       engines: list[str] | None = None, threads: int = 1, budget_mib: float | None = None,
                       budget_case: tuple[int, int] | None = None, device: str = "auto", dtype: str = "float32",
                       timeout_s: float | None = None, max_batch: int = 256, group_size: int = 1,
                       print_fn=print) -> list[dict]:
    """Print the long-context table (and, with `budget_mib`, the largest-batch table at `budget_case`, default the
    first case); return the rows (module docstring). `group_size` G > 1: the GRPO workload (module docstring)."""
    from stages.bench.floors import decode_floor_tokens_per_s
    from stages.common import vllm_sampler

    names = list(engines or LONG_ENGINES)
    for e in names:
        if e not in LONG_ENGINES:
            raise SmdInputError(f"--engines: {e!r}; with --long choose from {', '.join(LONG_ENGINES)}")
    if group_size < 1 or batch_size % group_size or max_batch < group_size:
        raise SmdInputError(f"--group-size {group_size}: with --long, a positive divisor of --batch-size "
                            f"({batch_size}) no larger than --max-batch ({max_batch})")
    if group_size > 1 and "vllm" in names:
        print_fn("--group-size: vLLM's column is left out (its KV cache is allocated up front for the batch, so its "
                 "peak per sequence is that sizing; `bench rollout --group-size` counts its prefix-cache blocks)")
        names.remove("vllm")
    if "vllm" in names and not vllm_sampler.available():
        print_fn(f"vLLM is not installed: its column is left out ({vllm_sampler.INSTALL_HINT})")
        names.remove("vllm")
    cases = cases or list(LONG_CASES)
    base = {"model": str(model_dir), "threads": threads, "keep_ratio": keep_ratio, "interval": interval,
            "prefill_chunk_tokens": prefill_chunk_tokens, "device": device, "dtype": dtype, "group_size": group_size}
    grouping = (f"GRPO groups of {group_size} samples a prompt (smd shares each prompt; generate expands it); "
                if group_size > 1 else "")
    bw = run_isolated({**base, "engine": "bandwidth"}, timeout_s)
    bandwidth = bw["bandwidth"] if bw else float("nan")
    print_fn(f"{model_dir}, {dtype}, {threads} thread(s) per engine, each run its own process; SnapKV keep "
             f"{keep_ratio}, smd-snapkv-k interval {interval}, smd prefill chunk {prefill_chunk_tokens} tokens; "
             f"{grouping}peak/seq = (peak - model and warm-up) / batch; floors (docs/design.md §4b): KV/seq = the "
             f"KV cache the engine holds, floor tok/s = batch / ((weights + KV a step reads) / {bandwidth / 1e9:.1f} "
             f"GB/s)")
    print_fn(f"{'prompt':>6} {'new':>5} {'batch':>5} {'engine':>13} {'tok/s':>7} {'decode tok/s':>12} "
             f"{'floor tok/s':>11} {'of floor':>8} {'prefill s':>9} {'x smd-dense':>11} {'x vllm':>7} "
             f"{'x generate':>10} {'peak/seq MiB':>12} {'x smd-dense':>11} {'KV/seq MiB':>10} {'peak/KV':>7}")
    rows: list[dict] = []
    for P, N in cases:
        res: dict[str, dict] = {}
        for e in names:
            r = run_isolated({**base, "engine": e, "batch": batch_size, "prompt": P, "new": N}, timeout_s)
            if r is None:
                print_fn(f"{P:>6} {N:>5} {batch_size:>5} {e:>13}  failed (out of memory or past the timeout)")
                continue
            r["tokens_per_s"] = r["tokens"] / r["seconds"]
            decode_s = r["seconds"] - r["prefill_s"]  # not positive when a noisy neighbour slowed the prefill run
            r["decode_tokens_per_s"] = r["batch"] * (N - 1) / decode_s if decode_s > 0 else float("nan")
            r["peak_per_seq_mib"] = (r["peak_mib"] - r["held_mib"]) / r["batch"]
            r["kv_per_seq_mib"] = r["kv_mib"] / r["batch"]
            r["floor_tokens_per_s"] = decode_floor_tokens_per_s(r["batch"], r["weight_bytes"], r["kv_read_bytes"],
                                                                bandwidth)
            res[e] = r
            # the table's rows wait for every engine (their ratios); a case takes 10-20 minutes an engine on one
            # CPU core, so each measurement is also said as it comes, and a stopped bench still reports
            print(f"# {P}+{N} x {r['batch']} {e}: {r['tokens_per_s']:.1f} tok/s, prefill {r['prefill_s']:.2f} s, "
                  f"peak/seq {r['peak_per_seq_mib']:.1f} MiB ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
        for e, r in res.items():
            row = {"table": "long", **r, "vs_smd_dense": _ratio(r, res, "smd-dense", "tokens_per_s"),
                   "vs_vllm": _ratio(r, res, "vllm", "tokens_per_s"),
                   "vs_generate": _ratio(r, res, "generate", "tokens_per_s"),
                   "mem_vs_smd_dense": _ratio(r, res, "smd-dense", "peak_per_seq_mib")}
            rows.append(row)
            print_fn(f"{P:>6} {N:>5} {r['batch']:>5} {e:>13} {r['tokens_per_s']:>7.1f} "
                     f"{r['decode_tokens_per_s']:>12.1f} {r['floor_tokens_per_s']:>11.1f} "
                     f"{r['decode_tokens_per_s'] / r['floor_tokens_per_s']:>8.2f} {r['prefill_s']:>9.2f} "
                     f"{row['vs_smd_dense']:>11.2f} {row['vs_vllm']:>7.2f} {row['vs_generate']:>10.2f} "
                     f"{r['peak_per_seq_mib']:>12.1f} {row['mem_vs_smd_dense']:>11.2f} {r['kv_per_seq_mib']:>10.1f} "
                     f"{r['peak_per_seq_mib'] / r['kv_per_seq_mib']:>7.2f}")
    if budget_mib:
        P, N = budget_case or cases[0]
        print_fn(f"memory budget {budget_mib:.0f} MiB beyond the model, {P} + {N} tokens: the largest batch each "
                 f"engine runs within it (doubling, then bisection; every probe a whole run)")
        print_fn(f"{'engine':>13} {'largest batch':>13} {'x smd-dense':>11} {'x vllm':>7} {'x generate':>10} "
                 f"{'peak MiB':>8} {'tok/s':>7}")
        found: dict[str, tuple[int, dict | None]] = {}
        for e in names:
            found[e] = largest_batch_by_running({**base, "engine": e, "prompt": P, "new": N}, budget_mib,
                                                max_batch, timeout_s)
        batches = {e: {"largest_batch": b} for e, (b, _) in found.items()}
        for e, (b, r) in found.items():
            row = {"table": "budget", "engine": e, "prompt": P, "new": N, "budget_mib": budget_mib,
                   "largest_batch": b, "vs_smd_dense": _ratio(batches[e], batches, "smd-dense", "largest_batch"),
                   "vs_vllm": _ratio(batches[e], batches, "vllm", "largest_batch"),
                   "vs_generate": _ratio(batches[e], batches, "generate", "largest_batch"),
                   "peak_mib": (r["peak_mib"] - r["held_mib"]) if r else float("nan"),
                   "tokens_per_s": r["tokens"] / r["seconds"] if r else float("nan")}
            rows.append(row)
            print_fn(f"{e:>13} {b:>13} {row['vs_smd_dense']:>11.2f} {row['vs_vllm']:>7.2f} "
                     f"{row['vs_generate']:>10.2f} {row['peak_mib']:>8.0f} {row['tokens_per_s']:>7.1f}")
    return rows


if __name__ == "__main__":  # the worker: one run, its JSON on the last line
    print(json.dumps(run_worker(json.loads(sys.argv[1]))))
