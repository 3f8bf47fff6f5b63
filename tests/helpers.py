"""Test helpers shared across test modules (tiny models, prompt tables, rollout-to-learner batches, synthetic
rollouts written to disk)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from schemas.params.model import TinyModelParams
from stages.learner.shadow_attention import pad_evict_at
from stages.synthetic_rollouts import synthetic_rollout, write_synthetic_inputs

SHAPES = {
    "gqa": TinyModelParams(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=128, max_position_embeddings=512),
    "mha": TinyModelParams(hidden_size=48, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                           head_dim=16, intermediate_size=96, max_position_embeddings=512),
}


def make_model_dir(root: Path, shape: str = "gqa", seed: int = 0) -> Path:
    from stages.model import init_tiny_model

    return init_tiny_model(SHAPES[shape], root / f"model-{shape}", seed=seed)


def random_prompts(lengths, vocab_low: int = 4, vocab_high: int = 120, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab_low, vocab_high, (n,), generator=g).tolist() for n in lengths]


def replay_batch(prompts, results):
    """Right-padded [B, T] ids and [L, B, H, T] evict_at for a learner forward over rollout results."""
    seqs = [p + r.response_ids for p, r in zip(prompts, results)]
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    evict_at = pad_evict_at([torch.from_numpy(r.evict_at) for r in results], T)
    rec = torch.zeros(len(seqs), max(len(r.logprobs) for r in results))
    for b, r in enumerate(results):
        rec[b, : len(r.logprobs)] = torch.tensor(r.logprobs)
    return ids, evict_at, rec


def make_inputs(
    directory: Path,
    policy: str,
    lengths: list[int],
    prompt_lens: list[int],
    *,
    num_layers: int = 4,
    num_kv_heads: int = 2,
    num_shards: int = 1,
    seed: int = 0,
    eviction: dict[str, Any] | None = None,
    permute: bool = True,
) -> dict[str, Any]:
    """Generate and write a synthetic rollout; returns paths, rows, shards and the expected masks."""
    table, shards, per_mask_row, eviction = synthetic_rollout(
        policy, lengths, prompt_lens, num_layers=num_layers, num_kv_heads=num_kv_heads, eviction=eviction,
        seed=seed, num_shards=num_shards, permute=permute,
    )
    traj, raw = write_synthetic_inputs(directory, table, shards, eviction, num_layers, num_kv_heads)
    return {
        "trajectories": traj,
        "raw": raw,
        "table": table,
        "shards": shards,
        "expected": per_mask_row,
        "eviction": eviction,
    }


def empty_params(directory: Path) -> Path:
    """An empty params file (all defaults; a params path that does not exist is an error)."""
    path = Path(directory) / "defaults.yaml"
    path.write_text("")
    return path


def write_prompt_splits(data: Path) -> Path:
    """Tiny train and eval prompt tables (3 random prompts each) in `data/`, as prepare writes them."""
    from schemas.tables import write_table

    for split, seed in (("train", 1), ("eval", 2)):
        rows = [{"prompt_id": f"{split}{i}", "task": "kv_retrieval", "prompt": "x", "prompt_token_ids": ids,
                 "reference": "cat 12"} for i, ids in enumerate(random_prompts([20, 26, 23], seed=seed))]
        write_table(rows, data / f"{split}.arrow", "prompts")
    return data


def float_bound(dtype: torch.dtype, reduction_size: int, scale: float) -> float:
    """The largest difference two evaluations of the same floating-point sum may show: a derived bound, not a
    guess. Why: the order of a reduction's additions is not fixed. Chunking (the learner's lm-head chunks),
    another SIMD kernel (MKL/oneDNN dispatch by `ATEN_CPU_CAPABILITY`, and by vendor: AMD and Intel take
    different paths) or another thread count all reorder it, so a fixed 1e-6 on float32 holds on one machine
    and fails on the next.

    Recursive summation of n terms satisfies |fl(s) - s| <= gamma_n * sum |x_i| with gamma_n = n u / (1 - n u)
    and u = eps / 2 (Higham, Accuracy and Stability of Numerical Algorithms, §4.2); any summation order
    (pairwise, blocked, SIMD lanes) obeys it. Two evaluations in different orders thus differ by at most
    2 gamma_n sum |x_i| ~= n * eps * scale, where `scale` bounds sum |x_i| / n (the magnitude of the terms, or of
    the result where the terms do not cancel) and `reduction_size` is the number of terms; for a value that
    passes through a chain of reductions (a dot product, then a log-sum-exp, then a backward matmul) pass the
    sum of the chain's lengths: the first-order errors of well-conditioned steps add.

    The bound is worst-case; real differences are ~sqrt(n) smaller, and a bug (a dropped chunk, a wrong mask)
    shows as an error of order `scale` itself, far above it. Check the algorithm itself in float64, where the
    same bound is ~1e-13 x scale."""
    eps = torch.finfo(dtype).eps
    n = max(1, int(reduction_size))
    if n * eps >= 1.0:
        raise ValueError(f"float_bound: {n} terms exceed the first-order bound for {dtype}")
    return n * eps * float(scale) / (1.0 - n * eps / 2)


def float32_bound(reduction_size: int, scale: float) -> float:
    """`float_bound` for float32 (eps 1.19e-7): the allowance for a float32 result computed in two orders."""
    return float_bound(torch.float32, reduction_size, scale)


def cpu_flex_supported() -> bool:
    """Whether torch.compile can build FlexAttention's CPU kernels here: Inductor needs a vector ISA (AVX2 or
    better) and has none with `ATEN_CPU_CAPABILITY=default` or on an x86-64 CPU without AVX2; the flex backend's
    CPU tests skip there (the learner's CPU default, `auto`, is sdpa)."""
    if torch.cuda.is_available():
        return True
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return bool(pick_vec_isa())


requires_cpu_flex = pytest.mark.skipif(not cpu_flex_supported(), reason="FlexAttention on CPU needs a vector ISA "
                                       "(AVX2+); Inductor has none with ATEN_CPU_CAPABILITY=default")


def within_float32_bound(got: torch.Tensor, want: torch.Tensor, reduction_size: int) -> bool:
    """max |got - want| <= `float32_bound(reduction_size, max(1, max |want|))`: two float32 computations of the
    same quantity in different orders (another kernel, tile or chunk size, thread count)."""
    scale = max(1.0, float(want.detach().abs().max()))
    return float((got.detach() - want.detach()).abs().max()) <= float32_bound(reduction_size, scale)


def attention_chain(keys: int, queries: int, head_dim: int) -> int:
    """Reduction lengths of an attention gradient: the q.k dot product, the softmax over the keys, and the
    backward's sums over the keys (dq) and over the queries (dk, dv)."""
    return head_dim + 2 * keys + queries


def model_chain(config, tokens: int) -> int:
    """Reduction lengths a parameter gradient of a causal LM passes through, forward and backward, per layer
    (attention over `tokens` keys, the projections and the MLP), plus the lm head's log-sum-exp over the
    vocabulary and the weight gradients' sum over the tokens."""
    layer = attention_chain(tokens, tokens, config.head_dim) + 3 * config.hidden_size + config.intermediate_size
    return 2 * config.num_hidden_layers * layer + config.hidden_size + 2 * config.vocab_size + tokens
