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

import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from schemas.errors import SmdInputError
from schemas.params.model import TinyModelParams
from schemas.params.rollout import POLICIES, EvictionParams
from stages.bench.profiling import log_operators, profiled
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


# ------------------------------------------------------------------ a real model (issue 31): `bench rollout --model DIR`
# Per prompt length: (sequences decoded together, as one batch). Sized so the whole bench of a 135M model runs in a
# few minutes on 2 cores: the prompt tokens per batch stay ~1-2k, so the prefill does not bury the decode.
MODEL_SHAPES: dict[int, int] = {256: 4, 1024: 2, 2048: 1}
MODEL_ENGINES = ("generate", "dense", "snapkv", "vllm")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Dense KV-cache bytes of one token: keys and values of every layer and KV head."""
    num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * num_kv * head_dim * dtype_bytes


def largest_batch(budget_bytes: int, bytes_per_sequence: float) -> int:
    """The most sequences whose KV caches fit `budget_bytes` together (0 when not even one fits)."""
    return int(budget_bytes // bytes_per_sequence) if bytes_per_sequence > 0 else 0


def _random_prompts(T: int, n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator(device="cpu").manual_seed(T)
    return [torch.randint(4, vocab, (T,), generator=g, device="cpu").tolist() for _ in range(n)]


class _ModelEngines:
    """The engines of `bench_rollout_model` over one policy directory: each `run(engine, prompts, new_tokens)`
    generates exactly `new_tokens` per prompt (sampling at temperature 1, EOS ignored) and returns
    (tokens made, KV-cache bytes the batch held)."""

    def __init__(self, model_dir: Path, model, keep_ratio: float, vllm_engine=None):
        self.model_dir, self.model, self.vllm = model_dir, model, vllm_engine
        self.keep_ratio = keep_ratio
        self.per_token = kv_bytes_per_token(model.config, next(model.parameters()).element_size())

    def run(self, engine: str, prompts: list[list[int]], new_tokens: int) -> tuple[int, int]:
        if engine == "generate":
            made = hf_generate(self.model, prompts, new_tokens, len(prompts))
            return made, self.per_token * sum(len(p) + new_tokens for p in prompts)
        if engine == "vllm":
            from stages.common.vllm_sampler import kv_cache_bytes

            # Cold: every run here repeats prompts an earlier run used (the rounds, the one-token prefill run), and
            # vLLM's prefix cache would serve them without a prefill (issue 40: the old column measured that hit).
            self.vllm.llm.reset_prefix_cache()
            out = self.vllm.generate(prompts, new_tokens, None, 1.0, list(range(len(prompts))))
            cfg = json.loads((self.model_dir / "config.json").read_text())
            kv = kv_cache_bytes(cfg, next(self.model.parameters()).element_size(),
                                max(map(len, prompts)) + new_tokens, len(prompts))
            return sum(len(r.response_ids) for r in out), kv
        ev = EvictionParams(policy=engine, keep_ratio=self.keep_ratio)
        made, kv, _ = smd_generate(self.model, prompts, ev, new_tokens, len(prompts))
        return made, kv


def _measure(engines: _ModelEngines, names: list[str], prompts_of: dict[str, list[list[int]]], new_tokens: int,
             repeats: int) -> dict[str, dict[str, float]]:
    """Per engine: the fastest of `repeats` interleaved runs of `new_tokens` tokens, and once a run of one token
    (the prefill and the first token): tok/s, decode tok/s (the other tokens over the time beyond that run),
    prefill seconds, peak working memory (peak RSS during the run minus RSS before it) and KV-cache bytes."""
    best: dict[str, float] = {}
    out: dict[str, dict[str, float]] = {e: {} for e in names}
    for _ in range(repeats):
        for e in names:
            prompts = prompts_of[e]
            _reset_peak(torch.device("cpu"))
            before = _rss_mib()
            t0 = time.perf_counter()
            made, kv = engines.run(e, prompts, new_tokens)
            dt = time.perf_counter() - t0
            work = _peak_mib(torch.device("cpu")) - before
            if dt < best.get(e, float("inf")):
                best[e] = dt
                out[e].update(made=made, seconds=dt, kv_bytes=kv)
            out[e]["work_mib"] = max(out[e].get("work_mib", 0.0), work)
    for e in names:
        t0 = time.perf_counter()
        engines.run(e, prompts_of[e], 1)
        prefill = time.perf_counter() - t0
        r = out[e]
        B = len(prompts_of[e])
        r.update(sequences=B, tokens_per_s=r["made"] / r["seconds"], prefill_s=prefill,
                 decode_tokens_per_s=B * (new_tokens - 1) / max(r["seconds"] - prefill, 1e-9))
    return out


def bench_rollout_model(model_dir: str | Path, lengths: list[int] | None = None, keep_ratio: float = 0.5,
                        new_tokens: int = 32, repeats: int = 2, engines: list[str] | None = None,
                        budget_length: int = 1024, budget_sequences: int = 4, print_fn=print,
                        batch_size: int | None = None) -> list[dict]:
    """`smdctl bench rollout --model DIR` on the CPU: transformers `generate`, smd dense, smd SnapKV at
    `keep_ratio` and vLLM's CPU build (dense, when installed) on random prompts of each length in `lengths`
    (batch per length: `batch_size`, else `MODEL_SHAPES`), `new_tokens` each; then a fixed KV-cache budget (the dense cache of
    `budget_sequences` sequences of `budget_length` prompt tokens plus `new_tokens`): per engine the largest
    batch whose cache fits it, and tokens/s at that batch. Prints both tables; returns their rows."""
    from stages.common import vllm_sampler
    from stages.common.model import load_policy

    model_dir = Path(model_dir)
    lengths = lengths or list(MODEL_SHAPES)
    names = list(engines or MODEL_ENGINES)
    for e in names:
        if e not in ("generate", "vllm", *POLICIES):
            raise SmdInputError(f"--engines: {e!r}; choose from generate, vllm, {', '.join(POLICIES)}")
    if "vllm" in names and not vllm_sampler.available():
        print_fn(f"vLLM is not installed: its column is left out ({vllm_sampler.INSTALL_HINT})")
        names.remove("vllm")
    model = load_policy(model_dir)
    vocab = model.config.vocab_size
    batches = {T: batch_size or MODEL_SHAPES.get(T, 1) for T in lengths}  # --batch-size, else the length's own
    budget_batch: dict[str, int] = {}
    per_token = kv_bytes_per_token(model.config, next(model.parameters()).element_size())
    budget = budget_sequences * (budget_length + new_tokens) * per_token
    vllm = None
    if "vllm" in names:
        cfg = json.loads((model_dir / "config.json").read_text())
        vllm_seq = vllm_sampler.kv_cache_bytes(cfg, 4, budget_length + new_tokens, 1)
        budget_batch["vllm"] = largest_batch(budget, vllm_seq)
        max_seqs = max([*batches.values(), budget_batch["vllm"]])
        vllm = vllm_sampler.VllmEngine(model_dir, "float32", max(max(lengths), budget_length) + new_tokens + 1,
                                       max_seqs)
    rows: list[dict] = []
    try:
        runner = _ModelEngines(model_dir, model, keep_ratio, vllm)
        print_fn(f"{model_dir}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
                 f"{model.config.num_hidden_layers} layers, float32 on the CPU, {torch.get_num_threads()} torch "
                 f"threads; random prompts, {new_tokens} new tokens each (temperature 1, EOS ignored); fastest of "
                 f"{repeats} interleaved rounds; SnapKV keep {keep_ratio}")
        print_fn(f"{'prompt':>6} {'batch':>5} {'engine':>9} {'tok/s':>7} {'decode tok/s':>12} {'prefill s':>9} "
                 f"{'x vllm':>7} {'x generate':>10} {'KV MiB':>7} {'work MiB':>8}")
        for T, B in batches.items():
            prompts = _random_prompts(T, B, vocab)
            res = _measure(runner, names, {e: prompts for e in names}, new_tokens, repeats)
            for e in names:
                r = res[e]
                row = {"table": "length", "prompt_tokens": T, "engine": e, **r,
                       "vs_vllm": r["tokens_per_s"] / res["vllm"]["tokens_per_s"] if "vllm" in res else float("nan"),
                       "vs_generate": (r["tokens_per_s"] / res["generate"]["tokens_per_s"] if "generate" in res
                                       else float("nan"))}
                rows.append(row)
                print_fn(f"{T:>6} {B:>5} {e:>9} {r['tokens_per_s']:>7.1f} {r['decode_tokens_per_s']:>12.1f} "
                         f"{r['prefill_s']:>9.2f} {row['vs_vllm']:>7.2f} {row['vs_generate']:>10.2f} "
                         f"{r['kv_bytes'] / 2**20:>7.1f} {r['work_mib']:>8.0f}")
            if T == budget_length and "snapkv" in res:
                snap_seq = res["snapkv"]["kv_bytes"] / B
                budget_batch.setdefault("snapkv", largest_batch(budget, snap_seq))
        dense_seq = (budget_length + new_tokens) * per_token
        for e in names:
            if e not in budget_batch:
                if e in ("generate", "dense"):
                    budget_batch[e] = largest_batch(budget, dense_seq)
                else:  # an evicting policy: its cache bytes per sequence at the budget shape, measured on one
                    ev = EvictionParams(policy=e, keep_ratio=keep_ratio)
                    _, kv, _ = smd_generate(model, _random_prompts(budget_length, 1, vocab), ev, new_tokens, 1)
                    budget_batch[e] = largest_batch(budget, kv)
        print_fn(f"KV-cache budget {budget / 2**20:.1f} MiB (the dense cache of {budget_sequences} x "
                 f"({budget_length} + {new_tokens}) tokens): the largest batch per engine and its tokens/s")
        print_fn(f"{'engine':>9} {'batch':>5} {'tok/s':>7} {'decode tok/s':>12} {'prefill s':>9} {'x vllm':>7} "
                 f"{'KV MiB':>7} {'work MiB':>8}")
        fits = [e for e in names if budget_batch[e] > 0]
        prompts_of = {e: _random_prompts(budget_length, budget_batch[e], vocab) for e in fits}
        res = _measure(runner, fits, prompts_of, new_tokens, repeats)
        for e in fits:
            r = res[e]
            row = {"table": "budget", "prompt_tokens": budget_length, "engine": e, "budget_bytes": budget, **r,
                   "vs_vllm": r["tokens_per_s"] / res["vllm"]["tokens_per_s"] if "vllm" in res else float("nan")}
            rows.append(row)
            print_fn(f"{e:>9} {r['sequences']:>5} {r['tokens_per_s']:>7.1f} {r['decode_tokens_per_s']:>12.1f} "
                     f"{r['prefill_s']:>9.2f} {row['vs_vllm']:>7.2f} {r['kv_bytes'] / 2**20:>7.1f} "
                     f"{r['work_mib']:>8.0f}")
    finally:
        if vllm is not None:
            vllm.close()
    return rows


# ------------------------------------------------------------------ the GRPO workload (issue 40): `--group-size G`
# Rows of `bench_rollout_groups`: smd's engine with the group's prompt prefilled once (rollout.share_prompt) and per
# sample, and vLLM sampling each prompt's G responses with `SamplingParams(n=G)`, its prefix caching on and off.
GROUP_ENGINES = ("smd-snapkv-shared", "smd-snapkv-shared-icdf", "smd-snapkv-per-sample", "smd-dense-shared",
                 "vllm-prefix-cache", "vllm-no-prefix-cache")


def group_prompts(num_prompts: int, prompt_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """`num_prompts` random prompts of `prompt_tokens` +- 7% tokens (the spec's prompts differ in length, so smd's
    batches are left-padded as in the rollout stage); another `seed` gives prompts no cache has seen."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    spread = max(1, prompt_tokens * 7 // 100)
    lens = torch.randint(max(1, prompt_tokens - spread), prompt_tokens + spread + 1, (num_prompts,), generator=g,
                         device="cpu").tolist()
    return [torch.randint(4, vocab, (n,), generator=g, device="cpu").tolist() for n in lens]


def grouped_kv_tokens(prompt_len: int, new_tokens: int, group_size: int, block_size: int) -> int:
    """Tokens of KV cache one group holds in a paged cache with prefix caching (vLLM's automatic prefix caching,
    SGLang's RadixAttention): the prompt's full blocks once, and per sample its prompt's partial last block
    (only full blocks are shared) and its response, in whole blocks."""
    shared = prompt_len // block_size * block_size
    own = -(-(prompt_len - shared + new_tokens) // block_size) * block_size
    return shared + group_size * own


def unshared_kv_tokens(prompt_len: int, new_tokens: int, group_size: int, block_size: int) -> int:
    """Tokens of KV cache one group holds in a paged cache without prefix caching: every sample its own blocks."""
    return group_size * (-(-(prompt_len + new_tokens) // block_size) * block_size)


def _smd_group_run(model, jobs: list[list[int]], eviction: EvictionParams, share: bool, new_tokens: int,
                   batch_size: int, group_size: int, sampler: str = "multinomial") -> tuple[int, float]:
    """smd's engine over the jobs, `batch_size` consecutive jobs per batch as the rollout stage runs them, drawing
    tokens with `sampler` (rollout.sampler): (tokens made, KV-cache bytes per group: the largest batch's slot
    tensors per sequence x G)."""
    made, per_group = 0, 0.0
    for s in range(0, len(jobs), batch_size):
        batch = jobs[s: s + batch_size]
        _, stats = generate_batch(model, batch, eviction, new_tokens, eos_token_id=None,
                                  generator=torch.Generator(device="cpu").manual_seed(s), share_prompt=share,
                                  sampler=sampler)
        made += stats.generated_tokens
        per_group = max(per_group, stats.cache_bytes / len(batch) * group_size)
    return made, per_group


def _vllm_group_run(engine, prompts: list[list[int]], new_tokens: int, group_size: int) -> int:
    """vLLM as GRPO users run it: one request per prompt with `n` = G samples (temperature 1, EOS ignored), all
    requests in one call; its prefix cache is emptied first, so a run never reuses an earlier run's prompts."""
    from vllm import SamplingParams, TokensPrompt

    engine.llm.reset_prefix_cache()
    params = SamplingParams(n=group_size, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return sum(len(sample.token_ids) for out in outputs for sample in out.outputs)


def _fastest_runs(run, warmup, repeats: int) -> tuple[float, Any]:
    """The untimed `warmup()` (first-call costs: allocation, kernel selection), then the fastest of `repeats`
    timed `run()`s: (seconds, what that run returned)."""
    warmup()
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = run()
        dt = time.perf_counter() - t0
        if dt < best:
            best, out = dt, res
    return best, out


def group_engine_spec(spec: str, batch_size: int) -> tuple[str, int]:
    """An `--engines` entry with `--group-size`: an engine of `GROUP_ENGINES`, optionally `@B` for B sequences
    decoded together instead of `--batch-size` (e.g. `smd-snapkv-shared@64`: sharing stores a group's prompt once,
    so the same KV bytes hold a larger batch). Returns (engine, batch size)."""
    name, _, batch = spec.partition("@")
    if name not in GROUP_ENGINES:
        raise SmdInputError(f"--engines: {name!r}; with --group-size choose from {', '.join(GROUP_ENGINES)}")
    if not batch:
        return name, batch_size
    if not batch.isdigit() or int(batch) < 1:
        raise SmdInputError(f"--engines: {spec!r}: the batch after '@' must be a whole number >= 1")
    return name, int(batch)


def bench_rollout_groups(model_dir: str | Path, group_size: int, lengths: list[int] | None = None,
                         num_prompts: int = 16, keep_ratio: float = 0.5, new_tokens: int = 16, batch_size: int = 16,
                         repeats: int = 2, engines: list[str] | None = None, profile: bool = False,
                         print_fn=print) -> list[dict]:
    """`smdctl bench rollout --model DIR --group-size G`: the GRPO workload, `num_prompts` prompts x G samples of
    `new_tokens` each (temperature 1, EOS ignored), per prompt length in `lengths` (default the spec's 140), float32
    on the CPU's cores this process may use (pin them with `taskset`; torch's thread count is printed).

    Rows (`GROUP_ENGINES`): smd SnapKV at `keep_ratio` with the prompt prefilled once per group (drawing tokens
    with torch.multinomial, and with rollout.sampler inverse_cdf: "-icdf") and per sample,
    smd dense shared (`batch_size` consecutive jobs per batch, as rollout.batch_size), vLLM with
    `SamplingParams(n=G)` and prefix caching on (a group's prompt computed and stored once: vLLM's automatic
    prefix caching, the sharing SGLang's RadixAttention also does) and off, `batch_size` sequences decoded
    together; an engine named `engine@B` decodes B sequences together instead (`group_engine_spec`), so one run can
    set a shared engine at the batch the per-sample engine's KV bytes would hold beside today's batch. Every engine
    runs an untimed warm-up (its first batch) first; the fastest of `repeats` runs counts;
    every timed vLLM run starts with an empty prefix cache. smd's runs are interleaved; the two vLLM engines run
    one after the other (one vLLM engine in a process at a time). KV bytes per group: smd's slot tensors (the
    largest batch's, per sequence x G); vLLM's, the blocks a group holds (`grouped_kv_tokens`,
    `unshared_kv_tokens`) at the longest prompt, and its tokens alone (a block of one token). Prints the table and
    returns its rows. `profile`: after the timed runs, one more untimed run of every engine under torch.profiler
    (vLLM runs in this process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`), its top operators printed after the table
    and in its row's "profile_ops" as (name, self CPU seconds, calls)."""
    import os

    from stages.common import vllm_sampler
    from stages.common.model import load_policy

    model_dir = Path(model_dir)
    names = list(dict.fromkeys(engines or GROUP_ENGINES))
    spec_of = {e: group_engine_spec(e, batch_size) for e in names}  # row label -> (engine, batch size)
    vllm_names = [e for e in names if e.startswith("vllm")]
    if vllm_names and not vllm_sampler.available():
        print_fn(f"vLLM is not installed: its rows are left out ({vllm_sampler.INSTALL_HINT})")
        names = [e for e in names if e not in vllm_names]
        vllm_names = []
    model = load_policy(model_dir, "float32")
    vocab = model.config.vocab_size
    per_token = kv_bytes_per_token(model.config, 4)
    lengths = lengths or [140]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    print_fn(f"{model_dir}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, float32 on the CPU, "
             f"{torch.get_num_threads()} torch threads, cores {','.join(map(str, cores)) or '?'}; GRPO workload "
             f"{num_prompts} prompts x G {group_size}, {new_tokens} new tokens each (temperature 1, EOS ignored), "
             f"{batch_size} sequences decoded together (an engine@B: B); an untimed warm-up run per engine, then "
             f"the fastest of {repeats}; every timed vLLM run starts with an empty prefix cache; SnapKV keep {keep_ratio}")
    print_fn("KV MiB/group: what the engine holds for one group (smd: its slot tensors; vLLM: the blocks of "
             "`block` tokens it allocates); token KV: vLLM's at a block of 1 token (the prompt once with prefix "
             "caching, plus every response), smd's slot tensors again; batch KV MiB: KV MiB/group x batch / G; "
             "x vllm-pc: against vllm-prefix-cache at --batch-size; x per-sample: against smd-snapkv-per-sample "
             "at --batch-size (smd before sharing)")
    print_fn(f"{'prompt':>6} {'engine':>26} {'batch':>5} {'seconds':>8} {'tok/s':>7} {'x vllm-pc':>9} "
             f"{'x per-sample':>12} {'KV MiB/group':>12} {'KV x vllm-pc':>12} {'token KV MiB':>12} {'x vllm-pc':>9} "
             f"{'batch KV MiB':>12}")
    rows: list[dict] = []
    profiles: dict[tuple[int, str], tuple[float, list]] = {}
    for T in lengths:
        prompts = group_prompts(num_prompts, T, vocab, seed=T)
        jobs = [p for p in prompts for _ in range(group_size)]  # as `group_jobs`: a group's samples adjacent
        longest = max(map(len, prompts))
        res: dict[str, dict[str, float]] = {}
        snapkv = EvictionParams(policy="snapkv", keep_ratio=keep_ratio)
        smd = {"smd-snapkv-shared": (snapkv, True, "multinomial"),
               "smd-snapkv-shared-icdf": (snapkv, True, "inverse_cdf"),
               "smd-snapkv-per-sample": (snapkv, False, "multinomial"),
               "smd-dense-shared": (EvictionParams(policy="dense"), True, "multinomial")}
        smd_runs = {e: (*smd[spec_of[e][0]], spec_of[e][1]) for e in names if spec_of[e][0] in smd}
        for ev, share, sampler, batch in smd_runs.values():  # warm-up: each engine's first batch
            _smd_group_run(model, jobs[:batch], ev, share, new_tokens, batch, group_size, sampler)
        for _ in range(repeats):
            for e, (ev, share, sampler, batch) in smd_runs.items():
                t0 = time.perf_counter()
                made, kv = _smd_group_run(model, jobs, ev, share, new_tokens, batch, group_size, sampler)
                dt = time.perf_counter() - t0
                if dt < res.get(e, {}).get("seconds", float("inf")):
                    res[e] = {"seconds": dt, "made": made, "kv_bytes_per_group": kv, "token_kv_bytes_per_group": kv}
        for e, (ev, share, sampler, batch) in smd_runs.items() if profile else ():
            profiles[T, e] = profiled(partial(_smd_group_run, model, jobs, ev, share, new_tokens, batch,
                                              group_size, sampler))
        for e in vllm_names:
            caching, batch = spec_of[e][0] == "vllm-prefix-cache", spec_of[e][1]
            engine = vllm_sampler.VllmEngine(model_dir, "float32", longest + new_tokens + 1, batch,
                                             prefix_caching=caching)
            try:
                block = int(engine.llm.llm_engine.vllm_config.cache_config.block_size)
                warm = prompts[: max(1, batch // group_size)]  # the first batch's groups
                dt, made = _fastest_runs(partial(_vllm_group_run, engine, prompts, new_tokens, group_size),
                                         partial(_vllm_group_run, engine, warm, new_tokens, group_size), repeats)
                if profile:
                    profiles[T, e] = profiled(partial(_vllm_group_run, engine, prompts, new_tokens, group_size))
            finally:
                engine.close()
            kv_tokens = grouped_kv_tokens if caching else unshared_kv_tokens
            res[e] = {"seconds": dt, "made": made, "block_size": block,
                      "kv_bytes_per_group": kv_tokens(longest, new_tokens, group_size, block) * per_token,
                      "token_kv_bytes_per_group": kv_tokens(longest, new_tokens, group_size, 1) * per_token}
        ref, today = res.get("vllm-prefix-cache"), res.get("smd-snapkv-per-sample")
        for e in names:
            r, batch = res[e], spec_of[e][1]
            rate = r["made"] / r["seconds"]
            vs = rate / (ref["made"] / ref["seconds"]) if ref else float("nan")
            vs_today = rate / (today["made"] / today["seconds"]) if today else float("nan")
            kv_vs = r["kv_bytes_per_group"] / ref["kv_bytes_per_group"] if ref else float("nan")
            tok_vs = r["token_kv_bytes_per_group"] / ref["token_kv_bytes_per_group"] if ref else float("nan")
            batch_kv = r["kv_bytes_per_group"] * batch / group_size
            rows.append({"prompt_tokens": T, "engine": spec_of[e][0], "label": e, "batch_size": batch,
                         "group_size": group_size, "prompts": num_prompts,
                         "new_tokens": new_tokens, "tokens_per_s": rate, "vs_vllm_prefix_cache": vs,
                         "vs_per_sample": vs_today, "kv_vs_vllm_prefix_cache": kv_vs,
                         "token_kv_vs_vllm_prefix_cache": tok_vs, "batch_kv_bytes": batch_kv, **r,
                         **({"profile_ops": profiles[T, e][1]} if (T, e) in profiles else {})})
            print_fn(f"{T:>6} {e:>26} {batch:>5} {r['seconds']:>8.2f} {rate:>7.1f} {vs:>9.2f} {vs_today:>12.2f} "
                     f"{r['kv_bytes_per_group'] / 2**20:>12.2f} {kv_vs:>12.2f} "
                     f"{r['token_kv_bytes_per_group'] / 2**20:>12.2f} {tok_vs:>9.2f} {batch_kv / 2**20:>12.2f}")
    for (T, e), (seconds, ops) in profiles.items():
        print_fn(f"# profile, {e} at {T} prompt tokens (one untimed run, profiler on: {seconds:.2f} s)")
        log_operators(ops, print_fn)
    return rows
