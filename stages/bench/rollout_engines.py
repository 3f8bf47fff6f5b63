"""`smdctl bench engine`: smd's engine (transformers, dense cache) vs vLLM for the dense generation, side by
side in one process.

Measured for each engine on the same policy and prompts: start-up (loading the policy: `load_policy` for
hf, `VllmEngine` for vllm), generated tokens/s for a dense rollout batch (`rollout.prompts_per_iteration`
prompts x `group_size` samples at `temperature`, `batch_size` sequences decoded together; per-row seeds for
vLLM, a seeded generator per batch for hf) and for evaluation (greedy on the eval prompts, `batch_size`
together), the fastest of `repeats` runs; and, as a check that both generate the same thing, the fraction
of eval prompts with identical greedy tokens. Without `--policy` the default tiny model (random init) is
built in a temporary directory; without `--prompts`, random prompts of `--prompt-tokens` tokens.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from schemas.params.model import TinyModelParams
from schemas.params.rollout import EvictionParams
from schemas.tables import read_table
from stages.common.kvcache.sampler import SampleResult, generate_batch
from stages.common.model import init_tiny_model, load_policy, load_tokenizer
from stages.common.vllm_sampler import VllmEngine, request_seed


def _fastest(run: Callable[[], list[SampleResult]], repeats: int) -> tuple[float, list[SampleResult]]:
    best, out = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best, out


def _batched(prompts: list[list[int]], batch_size: int, fn) -> list[SampleResult]:
    """smd's engine, batch by batch (as the stages run it): fn(first row, batch)."""
    out: list[SampleResult] = []
    for s in range(0, len(prompts), batch_size):
        out.extend(fn(s, prompts[s: s + batch_size]))
    return out


def bench_engines(policy: str | Path | None = None, prompts_path: str | Path | None = None, num_prompts: int = 128,
                  prompt_tokens: int = 110, rollout_prompts: int = 64, group_size: int = 8, new_tokens: int = 16,
                  batch_size: int = 16, temperature: float = 1.0, repeats: int = 2, dtype: str = "float32",
                  print_fn=print) -> dict[str, dict[str, float]]:
    """Returns {engine: {"startup_s", "rollout_tokens_per_s", "eval_tokens_per_s"}} plus "greedy_agreement"."""
    with tempfile.TemporaryDirectory() as tmp:
        if policy is None:
            policy = init_tiny_model(TinyModelParams(), Path(tmp) / "policy")
        tokenizer = load_tokenizer(policy)
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
        if prompts_path is not None:
            evals = [list(p["prompt_token_ids"]) for p in read_table(prompts_path, "prompts").to_pylist()][:num_prompts]
        else:
            g = torch.Generator().manual_seed(0)
            evals = [torch.randint(4, len(tokenizer), (prompt_tokens,), generator=g).tolist()
                     for _ in range(num_prompts)]
        jobs = [p for p in evals[:rollout_prompts] for _ in range(group_size)]  # one GRPO batch
        max_len = max(map(len, evals)) + new_tokens
        dense = EvictionParams(policy="dense")
        results: dict[str, dict[str, float]] = {}
        greedy: dict[str, list[SampleResult]] = {}

        t0 = time.perf_counter()
        model = load_policy(policy, dtype)
        hf_startup = time.perf_counter() - t0

        def hf_rollout(rows):
            return _batched(rows, batch_size, lambda s, batch: generate_batch(
                model, batch, dense, new_tokens, eos, pad, temperature, generator=torch.Generator().manual_seed(s))[0])

        def hf_eval(rows):
            return _batched(rows, batch_size, lambda s, batch: generate_batch(
                model, batch, dense, new_tokens, eos, pad, temperature=0.0)[0])

        engines = {"hf": (hf_startup, hf_rollout, hf_eval)}
        t0 = time.perf_counter()
        engine = VllmEngine(policy, dtype, max_len, batch_size)
        vllm_startup = time.perf_counter() - t0
        with engine:
            # vLLM gets every row in one call, as the stages give them (it keeps batch_size decoding)
            # Every run starts with an empty prefix cache: the repeats reuse their prompts, and vLLM would serve them
            # from the cache without a prefill (issue 40). Within a run the rollout's G copies of a prompt may share
            # it, as the rollout stage's vLLM engine does (prefix caching on).
            def vllm_rollout(rows):
                engine.llm.reset_prefix_cache()
                return engine.generate(rows, new_tokens, eos, temperature, [request_seed(0, 0, r) for r in range(len(rows))])

            def vllm_eval(rows):
                engine.llm.reset_prefix_cache()
                return engine.generate(rows, new_tokens, eos, 0.0)

            engines["vllm"] = (vllm_startup, vllm_rollout, vllm_eval)
            for name, (startup, rollout_fn, eval_fn) in engines.items():
                r_s, r_out = _fastest(lambda fn=rollout_fn: fn(jobs), repeats)
                e_s, e_out = _fastest(lambda fn=eval_fn: fn(evals), repeats)
                greedy[name] = e_out
                results[name] = {
                    "startup_s": startup,
                    "rollout_tokens_per_s": sum(len(r.response_ids) for r in r_out) / r_s,
                    "eval_tokens_per_s": sum(len(r.response_ids) for r in e_out) / e_s,
                    "rollout_tokens": float(sum(len(r.response_ids) for r in r_out)),
                    "eval_tokens": float(sum(len(r.response_ids) for r in e_out)),
                }
        agreement = sum(a.response_ids == b.response_ids for a, b in zip(greedy["hf"], greedy["vllm"])) / len(evals)
    hf, vl = results["hf"], results["vllm"]
    print_fn(f"dense generation, {len(evals)} eval prompts (~{sum(map(len, evals)) // len(evals)} tokens), "
             f"rollout batch {rollout_prompts} x {group_size} at T={temperature}, {new_tokens} new tokens, "
             f"{batch_size} sequences together, {torch.get_num_threads()} torch threads, fastest of {repeats}")
    print_fn(f"{'':<22} {'hf':>10} {'vllm':>10} {'vllm/hf':>8}")
    for key, label in (("startup_s", "start-up s"), ("rollout_tokens_per_s", "rollout tokens/s"),
                       ("eval_tokens_per_s", "eval tokens/s")):
        print_fn(f"{label:<22} {hf[key]:>10.2f} {vl[key]:>10.2f} {vl[key] / hf[key]:>8.2f}")
    print_fn(f"greedy tokens identical on {agreement:.3f} of the eval prompts")
    return {**results, "greedy_agreement": {"fraction": agreement}}
