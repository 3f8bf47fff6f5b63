"""`smdctl bench learner`: one learner step (forward + backward + AdamW step) of a model shape (`--shape`: `tiny`,
the default experiment's model, or `qwen3-vocab`, Qwen3's 151,936-token vocabulary and GQA heads on a small
body) at several sequence lengths, side by side:

  dense        the naive learner: dense causal forward with gradient (SDPA, flash kernel), GRPO loss
  smd flex     SMD as `smdctl learn` runs it: the prefill rows (identical for both policies) once, then
               the response rows densely under no_grad (teacher) and shadow-masked with gradient through
               FlexAttention (block mask from evict_at, built every step); full-vocabulary KL
  smd tiled    the same on the tiled backend: query tiles through the CPU flash-attention kernel, forward and
               backward, over the keys each head still sees (`learner.attention_backend: tiled`)
  smd sdpa     the same on the reference backend: an explicit [B, H, T, T] boolean mask per layer
  fwd_bwd      a plain Hugging Face forward-backward of the same model (labels, response-only loss)
  *_full       dense / smd flex on [B, R, V] float32 logits: the learner before the chunked lm head (issue 16)
  smd gather   SMD as a KV-eviction learner would do it: per query block, physically gather the keys/values
               any query of the block still sees (copies kept for backward), then masked attention (whole
               sequence; dense teacher as a separate no_grad pass first)

Time: per T, one subprocess builds the model once, warms every learner up (FlexAttention compiles) and
then times them round-robin (`rounds` rounds, median): load drift on the shared machine hits all alike.
Memory: per T and learner, its own subprocess (peak memory is per process on a CPU): a warm-up step, then
one step whose working memory is measured: peak resident set (VmHWM, reset through /proc/self/clear_refs)
minus the resident set just before it (model, optimizer state, inputs), with glibc set to mmap every
allocation >= 64 KiB (mallopt) so that the resident set follows live memory.

Masks are synthetic SnapKV-like schedules (`stages.bench.synthetic_rollouts`, keep ratio 0.5) over a
prompt of 3/4 T and a response of T/4 (the learner's loss covers the response). Random weights.
Times are CPU times on a shared machine: ratios are what count; on CPU FlexAttention has no fused
backward, so the smd flex step uses the block-sparse torch backward of `flex_backend`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODES = ("dense", "smd_flex", "smd_tiled", "smd_sdpa", "smd_gather", "fwd_bwd", "dense_full", "smd_flex_full")
LABELS = {"dense": "dense", "smd_flex": "smd flex", "smd_tiled": "smd tiled", "smd_sdpa": "smd sdpa (ref)", "smd_gather": "smd gather (KV slicing)",
          "fwd_bwd": "plain fwd-bwd (HF loss)", "dense_full": "dense, full logits", "smd_flex_full": "smd flex, full logits"}
TARGET_TIME = 1.4
TARGET_MEMORY = 1.05

# Model shapes. `tiny`: the default experiment's model and vocabulary. `qwen3-vocab`: Qwen3's real vocabulary
# (151,936) and GQA head layout (16 query / 8 KV heads as Qwen3-0.6B and 1.7B; head_dim 64 instead of 128 and
# hidden 256, 2 layers, so that a step at T = 4096 fits this machine and a few minutes: the lm head is most of it).
# Qwen3-0.6B's decoder layer and vocabulary (the `qwen3-0.6b-*` shapes add the depth)
_QWEN3_06B_LAYER: dict[str, Any] = {"vocab_size": 151_936, "hidden_size": 1024, "intermediate_size": 3072,
                                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                                    "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6}
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "qwen3-vocab": {"vocab_size": 151_936, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64},
    # Qwen3-1.7B's config (hidden 2048, 28 layers, 16 q / 8 KV heads of 128, MLP 6144, tied embeddings, RoPE base
    # 1e6): the GPU check's shape (scripts/gpu_check.py), random weights.
    "qwen3-1.7b": {"vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1_000_000.0,
                   "rms_norm_eps": 1e-6},
    # Qwen3-0.6B's decoder layer and vocabulary (hidden 1024, 16 q / 8 KV heads of 128, MLP 3072, RoPE base 1e6, tied
    # embeddings) with 4 of its 28 layers: the per-token activations of a long sequence dominate the step, as in the
    # real model, while a CPU step at T = 8192 stays a few minutes (`bench learner --sequence-parallel`: 8 KV heads
    # split by 2, 4 or 8 processes).
    "qwen3-0.6b-4l": {**_QWEN3_06B_LAYER, "num_hidden_layers": 4},
    # the same with 8 of its 28 layers: the depth at which the activations, which sequence parallelism splits, are
    # most of a step at T = 8192 as in the real model, while one process's step still fits this machine (~11 GB)
    "qwen3-0.6b-8l": {**_QWEN3_06B_LAYER, "num_hidden_layers": 8},
}
SHAPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {"lengths": (512, 2048, 4096), "modes": ("dense", "smd_flex", "smd_tiled", "smd_sdpa", "smd_gather"),
             "target_memory": TARGET_MEMORY},
    # issue 16's targets: smd peak <= 1.1 x the dense learner's and a plain forward-backward's; time <= 1.4 x dense
    "qwen3-vocab": {"lengths": (1024, 4096), "modes": ("dense", "smd_flex", "smd_tiled", "fwd_bwd", "dense_full",
                                                       "smd_flex_full"),
                    "target_memory": 1.1},
    # a GPU shape (the paper's figures: smd 100% of dense memory, physical slicing 150%)
    "qwen3-1.7b": {"lengths": (4096, 16384), "modes": ("dense", "smd_flex", "smd_gather"), "target_memory": 1.1},
    "qwen3-0.6b-4l": {"lengths": (1024, 4096), "modes": ("dense", "smd_tiled"), "target_memory": 1.1},
}
SHAPE_DEFAULTS["qwen3-0.6b-8l"] = SHAPE_DEFAULTS["qwen3-0.6b-4l"]
GATHER_ATTENTION = "smd_gather_bench"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _malloc_live_tracking() -> None:
    """glibc: mmap every allocation >= 64 KiB (freed memory leaves the process) and trim the heap now."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def gather_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Physical KV slicing: per query block, gather the keys/values visible to any of its queries."""
    import torch
    import torch.nn.functional as F

    ev = kwargs["smd_evict_at"][module.layer_idx]  # [B, H, T]
    bs = kwargs.get("smd_gather_block", 128)
    B, Hq, T, D = query.shape
    H = key.shape[1]
    G = Hq // H
    scaling = scaling if scaling is not None else D**-0.5
    pos = torch.arange(T, device=query.device)
    outs = []
    for start in range(0, T, bs):
        stop = min(start + bs, T)
        seen = (pos <= stop - 1) & (ev > start)  # [B, H, T]: keys some query of the block sees
        n = int(seen.sum(-1).max())
        idx = torch.argsort((~seen).to(torch.int8), dim=-1, stable=True)[..., :n]  # [B, H, n]
        k_i = key.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, D))  # copies, saved for backward
        v_i = value.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, D))
        q_pos = pos[start:stop].view(1, 1, -1, 1)
        mask = (idx.unsqueeze(2) <= q_pos) & (ev.gather(2, idx).unsqueeze(2) > q_pos)  # [B, H, bs, n]
        outs.append(F.scaled_dot_product_attention(query[:, :, start:stop], k_i, v_i,
                                                   attn_mask=mask.repeat_interleave(G, 1), scale=scaling,
                                                   enable_gqa=G > 1))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _setup(T: int, num_layers: int, num_kv_heads: int, vocab_size: int, seed: int = 0,
           device: str = "cpu") -> dict[str, Any]:
    """One synthetic sequence of T tokens (prompt 3T/4) with SnapKV-like masks, built on the host (seeded, the
    same on every device) and copied to `device` once."""
    import numpy as np
    import torch

    from stages.bench.synthetic_rollouts import eviction_config, synthetic_evict_at
    from stages.learner.shadow_attention import pad_evict_at

    P, R = (3 * T) // 4, T - (3 * T) // 4
    rng = np.random.default_rng(seed)
    ev = synthetic_evict_at("snapkv", T, P, num_layers, num_kv_heads, eviction_config("snapkv", 0.5),
                            rng).astype(np.int64)
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(4, min(250, vocab_size) if vocab_size < 1000 else vocab_size, (1, T), generator=g,
                        device="cpu")
    return {
        "ids": ids.to(device),
        "evict_at": pad_evict_at([torch.from_numpy(ev)], T).to(device),
        "prompt_lens": [P],
        "resp_lens": [R],
        "advantages": torch.tensor([1.0], device=device),
    }


def build_bench_model(shape: str, T: int, device: str = "cpu", dtype: str = "float32"):
    """The model of `shape` (random weights, seed 0), positions for T tokens, on `device` in `dtype` (a large
    shape is initialised on the device itself: a 1.7B model initialises in a second on a GPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from schemas.errors import SmdInputError
    from schemas.params.model import TinyModelParams
    from stages.common.model import build_tiny_model
    from stages.common.vocab import tiny_vocabulary

    if is_model_dir(shape):  # a real model's weights (`--model DIR`)
        from stages.common.model import load_policy

        return load_policy(shape, dtype=dtype, device=device)
    if shape not in SHAPES:
        raise SmdInputError(f"bench learner: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    import torch

    from stages.common.model import DTYPES

    if shape == "tiny":
        tiny = TinyModelParams().model_copy(update={"max_position_embeddings": max(T, 8192)})
        return build_tiny_model(tiny, vocab_size=len(tiny_vocabulary()), seed=0).to(device=device,
                                                                                     dtype=DTYPES[dtype])
    torch.manual_seed(0)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed(0)
    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=max(T, 8192), tie_word_embeddings=True,
                         bos_token_id=2, eos_token_id=3, pad_token_id=0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype=DTYPES[dtype])


def is_model_dir(shape: str) -> bool:
    """Whether `shape` names a model directory (`bench learner --model DIR`) rather than one of `SHAPES`."""
    return shape not in SHAPES and (Path(shape) / "config.json").is_file()


def weights_note(shape: str) -> str:
    return "" if is_model_dir(shape) else "random weights, "


# `--model DIR`: lengths and learners sized for a 135M model on 2 cores (the CPU learner's default backend is sdpa).
MODEL_DEFAULTS: dict[str, Any] = {"lengths": (256, 1024), "modes": ("dense", "smd_tiled", "smd_sdpa"),
                                  "target_memory": TARGET_MEMORY}


def describe_shape(shape: str) -> str:
    from schemas.params.model import TinyModelParams
    from stages.common.vocab import tiny_vocabulary

    if is_model_dir(shape):
        c = json.loads((Path(shape) / "config.json").read_text())
        c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
        return (f"{shape} ({c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} q / "
                f"{c.get('num_key_value_heads', c['num_attention_heads'])} kv heads, head_dim {c['head_dim']}, "
                f"vocabulary {c['vocab_size']:,}, its own weights)")
    if shape == "tiny":
        t = TinyModelParams()
        c = {"vocab_size": len(tiny_vocabulary()), **t.model_dump()}
    else:
        c = SHAPES[shape]
    return (f"{shape} model ({c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} q / "
            f"{c['num_key_value_heads']} kv heads, head_dim {c['head_dim']}, vocabulary {c['vocab_size']:,})")


class _Learner:
    """A model of `shape`, one AdamW, and a `step(mode)` per learner on one prepared sequence of T tokens."""

    def __init__(self, T: int, block_size: int, threads: int, shape: str = "tiny", chunk_tokens: int | None = None,
                 device: str = "cpu", dtype: str = "float32"):
        import torch
        from transformers import AttentionInterface

        from schemas.params.learner import LearnerParams
        from stages.common.model import configure_precision
        from stages.learner.objectives import token_logprobs
        from stages.learner.shadow_attention import response_logits

        if threads:
            torch.set_num_threads(threads)
        AttentionInterface.register(GATHER_ATTENTION, gather_attention)
        self.model = build_bench_model(shape, T, device, dtype)
        configure_precision(device, next(self.model.parameters()).dtype)
        self.model.set_attn_implementation("sdpa")
        self.model.eval()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.params = LearnerParams()  # the default objective's hyperparameters
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens or LearnerParams().logit_chunk_tokens
        cfg = self.model.config
        b = _setup(T, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size, device=device)
        with torch.no_grad():
            sel, targets, valid = response_logits(self.model, b["ids"], None, b["prompt_lens"], b["resp_lens"])
            b["rollout"] = token_logprobs(sel, targets).masked_fill(~valid, 0.0)
            del sel
        self.batch = b

    def step(self, mode: str) -> None:
        """One learner step of `mode`: smd_* and dense as `smdctl learn` runs them (chunked lm head); *_full the
        same on [B, R, V] logits (the learner before issue 16); fwd_bwd a plain Hugging Face forward-backward
        (`labels`, response-only loss, logits of the response positions)."""
        import torch

        from stages.bench.full_logits import full_logits_objective_loss
        from stages.common.model import attention_implementation
        from stages.learner.logprobs import accumulate_head_grad, chunked_token_scores, lm_head_of
        from stages.learner.objectives import ObjectiveBatch, objective_loss, token_logprobs
        from stages.learner.shadow_attention import (
            response_hidden,
            response_hidden_with_teacher,
            response_logits,
            response_logits_with_teacher,
        )

        model, b = self.model, self.batch
        smd, dense = self.params, self.params.model_copy(update={"objective": "dense"})
        args = (b["ids"], b["evict_at"], b["prompt_lens"], b["resp_lens"])
        if mode == "fwd_bwd":
            keep = b["resp_lens"][0] + 1  # logits of the last prompt position and the response positions
            logits = model(input_ids=b["ids"], use_cache=False, logits_to_keep=keep).logits
            loss = model.loss_function(logits=logits, labels=b["ids"][:, -keep:], vocab_size=model.config.vocab_size)
        elif mode in ("dense", "smd_flex", "smd_tiled", "smd_sdpa"):
            if mode == "dense":
                hidden, targets, valid = response_hidden(model, b["ids"], None, b["prompt_lens"], b["resp_lens"])
                teacher = None
            else:
                hidden, teacher, targets, valid = response_hidden_with_teacher(model, *args, mode[4:], self.block_size)
            scores = chunked_token_scores(hidden, lm_head_of(model), targets, valid, chunk_tokens=self.chunk_tokens,
                                          teacher_hidden=teacher, accumulate_head_grad=accumulate_head_grad(model, 0))
            batch = ObjectiveBatch(advantages=b["advantages"], mask=valid, rollout_logp=b["rollout"])
            if mode == "dense":
                loss, _ = objective_loss(dense, dataclasses.replace(batch, dense_logp=scores["logp"]))
            else:
                loss, _ = objective_loss(smd, dataclasses.replace(batch, masked_logp=scores["logp"],
                                                                  kl_per_token=scores["kl"]))
        else:
            if mode == "smd_flex_full":  # as `smdctl learn` did before chunking: teacher and policy share the prefill
                sel, dsel, targets, valid = response_logits_with_teacher(model, *args, "flex", self.block_size)
            elif mode == "smd_gather":  # the gathering learner: separate teacher pass first
                with torch.no_grad():
                    dsel, _, _ = response_logits(model, b["ids"], None, b["prompt_lens"], b["resp_lens"])
                with attention_implementation(model, GATHER_ATTENTION):
                    sel, targets, valid = _gather_logits(model, b, self.block_size)
            else:  # dense_full
                sel, targets, valid = response_logits(model, b["ids"], None, b["prompt_lens"], b["resp_lens"])
            logp = token_logprobs(sel, targets).masked_fill(~valid, 0.0)
            batch = ObjectiveBatch(advantages=b["advantages"], mask=valid, rollout_logp=b["rollout"])
            if mode == "dense_full":
                loss, _ = objective_loss(dense, dataclasses.replace(batch, dense_logp=logp))
            else:
                loss, _ = full_logits_objective_loss(smd, dataclasses.replace(batch, masked_logp=logp),
                                                     masked_logits=sel, dense_logits=dsel)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _child_time(modes: list[str], T: int, rounds: int, block_size: int, threads: int, shape: str = "tiny",
                chunk_tokens: int | None = None) -> dict[str, Any]:
    """Step times of all learners in one process, interleaved round-robin (load drift hits all alike)."""
    learner = _Learner(T, block_size, threads, shape, chunk_tokens)
    for mode in modes:
        learner.step(mode)  # warm-up: compiles FlexAttention, warms the kernels, allocates the AdamW state
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode in modes:
            t0 = time.perf_counter()
            learner.step(mode)
            times[mode].append(time.perf_counter() - t0)
    return {m: {"step_s": statistics.median(ts), "times": ts} for m, ts in times.items()}


def _child_memory(mode: str, T: int, block_size: int, threads: int, shape: str = "tiny",
                  chunk_tokens: int | None = None) -> dict[str, Any]:
    """Peak working memory of one learner step, alone in this process (after a warm-up step)."""
    learner = _Learner(T, block_size, threads, shape, chunk_tokens)
    learner.step(mode)
    # Large allocations mmapped from now on (returned to the OS on free): the resident set follows live memory.
    _malloc_live_tracking()
    gc.collect()
    can_reset = _reset_peak()
    base = _status_kib("VmRSS")
    learner.step(mode)
    hwm = _status_kib("VmHWM")
    return {"peak_mb": (hwm - base) / 1024 if can_reset else float("nan"), "base_mb": base / 1024,
            "hwm_mb": hwm / 1024}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")  # (NaN > 0 is False: NaN)


def _sync(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _start_peak(device) -> tuple[int, bool]:
    """Start a peak-memory measurement: the bytes in use now and whether the peak was reset. CUDA: the allocator's
    peak is reset (read it with `max_memory_allocated`); CPU: glibc returns freed memory from now on, then VmHWM is
    reset (False where the kernel refuses; read it with `_status_kib("VmHWM")`)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device), True
    _malloc_live_tracking()
    gc.collect()
    can_reset = _reset_peak()
    return _status_kib("VmRSS") * 1024, can_reset


def measure_steps(shape: str, lengths, modes, device: str = "cpu", dtype: str = "float32", rounds: int = 2,
                  block_size: int = 128, chunk_tokens: int | None = None,
                  on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """The learners side by side in this process, on `device` (the GPU check, scripts/gpu_check.py): per T one
    model of `shape`; per learner a warm-up step (FlexAttention compiles, AdamW allocates its state), then
    `rounds` timed steps (synchronised; the median counts) and the working memory of one step on CUDA:
    `torch.cuda.max_memory_allocated` minus the memory allocated before it (model, AdamW state and inputs
    excluded, as `run_learner_bench` excludes them from RSS). On the CPU peak is NaN (`run_learner_bench`
    measures RSS in a process per learner). A learner that runs out of memory gets status "OOM at N GiB" (the
    peak allocated since its start), any other exception "ERROR: <its one-line cause>"; the others still run.
    Rows: T, mode, status, step_s, peak_mb, and time / memory ratios to dense at the same T (dense measured
    before them); `on_row` gets each row the moment it is complete (the GPU check writes it out at once)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    rows: list[dict[str, Any]] = []

    def failed(exc: BaseException) -> str:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return f"OOM at {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
        text = str(exc).strip().splitlines()
        return f"ERROR: {type(exc).__name__}" + (f": {text[0][:120]}" if text else "")

    def finish(row: dict[str, Any], dense: dict[str, Any]) -> None:
        row["time_ratio"] = _ratio(row["step_s"], dense.get("step_s", float("nan")))
        row["mem_ratio"] = _ratio(row["peak_mb"], dense.get("peak_mb", float("nan")))
        rows.append(row)
        if on_row is not None:
            on_row(row)

    for T in lengths:
        learner = None
        per_mode: dict[str, dict[str, Any]] = {}
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            learner = _Learner(T, block_size, 0, shape, chunk_tokens, device=device, dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - the model itself does not fit or build: every learner's row
            status = failed(exc)
            for mode in modes:
                finish({"T": T, "mode": mode, "status": status, "step_s": float("nan"), "peak_mb": float("nan")}, {})
            continue
        try:
            for mode in sorted(modes, key=lambda m: m != "dense"):  # dense first: the others' ratios need it
                row: dict[str, Any] = {"T": T, "mode": mode, "status": "ok", "step_s": float("nan"),
                                       "peak_mb": float("nan")}
                try:
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    learner.step(mode)  # warm-up
                    _sync(device)
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                        base = torch.cuda.memory_allocated(device)
                    times = []
                    for _ in range(max(rounds, 1)):
                        t0 = time.perf_counter()
                        learner.step(mode)
                        _sync(device)
                        times.append(time.perf_counter() - t0)
                    row["step_s"] = statistics.median(times)
                    if cuda:
                        row["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
                except Exception as exc:  # noqa: BLE001 - one learner's failure is its row; the others still run
                    row["status"] = failed(exc)
                    learner.opt.zero_grad(set_to_none=True)
                per_mode[mode] = row
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                finish(row, per_mode.get("dense", {}))
        finally:
            del learner
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return rows


def _gather_logits(model, b: dict, block_size: int):
    """response_logits through the gathering attention (mirrors shadow_attention.response_logits)."""
    import torch

    from stages.learner.shadow_attention import gather_response

    ids = b["ids"]
    B, T = ids.shape
    start = min(b["prompt_lens"]) - 1
    position_ids = torch.arange(T, device=ids.device).unsqueeze(0).expand(B, T)
    out = model(input_ids=ids, position_ids=position_ids, use_cache=False, logits_to_keep=T - start,
                smd_evict_at=b["evict_at"], smd_gather_block=block_size).logits
    (sel,), targets, valid = gather_response((out,), ids, b["prompt_lens"], b["resp_lens"], start)
    return sel, targets, valid


def _run_child(args: dict[str, Any], env: dict[str, str], timeout_s: int) -> tuple[dict[str, Any] | None, str]:
    cmd = [sys.executable, "-m", "stages.bench.learner", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return None, tail[0][:120]
    return json.loads(lines[-1]), ""


def run_learner_bench(lengths=None, modes=None, rounds: int = 3, block_size: int = 128, threads: int = 1,
                      timeout_s: int = 3600, print_fn=print, shape: str = "tiny",
                      chunk_tokens: int | None = None, device: str = "cpu",
                      dtype: str = "float32") -> list[dict[str, Any]]:
    """Per T: one subprocess times every learner (interleaved rounds), one subprocess per learner measures its
    peak memory. Prints the table and the targets; returns the rows. `lengths` / `modes` None: the shape's
    defaults (`SHAPE_DEFAULTS`). `device` (model.device's values): a GPU runs every learner in this process
    (`measure_steps`: CUDA's peak allocation per step needs no process per learner), in `dtype`."""
    from schemas.errors import SmdInputError
    from schemas.params.learner import LearnerParams
    from stages.common.model import DTYPES, resolve_device

    where = resolve_device(device)
    if dtype not in DTYPES:
        raise SmdInputError(f"bench learner: dtype {dtype!r}; choose from {', '.join(DTYPES)}")

    if shape not in SHAPES and not is_model_dir(shape):
        raise SmdInputError(f"bench learner: unknown shape {shape!r}; choose from {', '.join(SHAPES)} or give a model "
                            "directory (--model)")
    defaults = MODEL_DEFAULTS if is_model_dir(shape) else SHAPE_DEFAULTS[shape]
    lengths = list(lengths or defaults["lengths"])
    modes = list(modes or defaults["modes"])
    for mode in modes:
        if mode not in MODES:
            raise SmdInputError(f"bench learner: unknown learner {mode!r}; choose from {', '.join(MODES)}")
    if "dense" not in modes:
        modes = ["dense", *modes]
    if not lengths or min(lengths) < 16:
        raise SmdInputError("bench learner: lengths must be >= 16 tokens")
    chunk_tokens = chunk_tokens or LearnerParams().logit_chunk_tokens
    if where.type == "cuda":
        print_fn(f"bench learner on {where} ({dtype}): {describe_shape(shape)}, {weights_note(shape)}1 sequence of T "
                 f"tokens (prompt 3T/4), SnapKV-like masks keep 0.5; step = forward + backward + AdamW, median of "
                 f"{rounds} after a warm-up; peak = CUDA allocation during a step minus before it")
        print_fn(f"{'T':>6}  {'learner':<24}{'step s':>8}{'x dense':>9}{'peak MiB':>10}{'x dense':>9}")
        rows = measure_steps(shape, lengths, modes, device=str(where), dtype=dtype, rounds=rounds,
                             block_size=block_size, chunk_tokens=chunk_tokens)
        for r in rows:
            if r["status"] != "ok":
                print_fn(f"{r['T']:>6}  {LABELS[r['mode']]:<24}{r['status']:>8}")
                continue
            print_fn(f"{r['T']:>6}  {LABELS[r['mode']]:<24}{r['step_s']:>8.3f}{r['time_ratio']:>8.2f}x"
                     f"{r['peak_mb']:>10.0f}{r['mem_ratio']:>8.2f}x")
        return rows
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    rows: list[dict[str, Any]] = []
    print_fn(f"bench learner: {describe_shape(shape)}, {weights_note(shape)}1 sequence of T tokens "
             f"(prompt 3T/4, response T/4), SnapKV-like masks keep 0.5, flex block {block_size}, lm head in chunks of "
             f"{chunk_tokens} tokens, {threads or 'default'} torch thread(s). Step = forward + backward + AdamW. "
             f"Time: median of {rounds} interleaved rounds in one process per T; peak = step working memory (peak RSS "
             f"minus RSS before the step: model, AdamW state and inputs excluded), one process per learner")
    has_plain = "fwd_bwd" in modes
    print_fn(f"{'T':>5}  {'learner':<24}{'step s':>8}{'x dense':>9}{'peak MiB':>10}{'x dense':>9}"
             + (f"{'x fwd-bwd':>11}" if has_plain else "") + f"{'RSS MiB':>9}")
    common = {"block_size": block_size, "threads": threads, "shape": shape, "chunk_tokens": chunk_tokens}
    for T in lengths:
        timing, err = _run_child({"kind": "time", "modes": modes, "T": T, "rounds": rounds, **common}, env, timeout_s)
        if timing is None:
            print_fn(f"{T:>5}  timing failed: {err}")
            continue
        per_mode: dict[str, dict[str, Any]] = {}
        for mode in modes:
            mem, err = _run_child({"kind": "memory", "mode": mode, "T": T, **common}, env, timeout_s)
            if mem is None:
                print_fn(f"{T:>5}  {LABELS[mode]:<24} memory run failed: {err}")
                mem = {"peak_mb": float("nan"), "hwm_mb": float("nan"), "base_mb": float("nan")}
            per_mode[mode] = {"mode": mode, "T": T, "shape": shape, **timing[mode], **mem}
        dense, plain = per_mode["dense"], per_mode.get("fwd_bwd")
        for mode in modes:
            r = per_mode[mode]
            r["time_ratio"] = r["step_s"] / dense["step_s"]
            r["mem_ratio"] = r["peak_mb"] / dense["peak_mb"] if dense["peak_mb"] > 0 else float("nan")
            r["mem_ratio_plain"] = (r["peak_mb"] / plain["peak_mb"] if plain and plain["peak_mb"] > 0
                                    else float("nan"))
            rows.append(r)
            print_fn(f"{T:>5}  {LABELS[mode]:<24}{r['step_s']:>8.3f}{r['time_ratio']:>8.2f}x{r['peak_mb']:>10.1f}"
                     f"{r['mem_ratio']:>8.2f}x" + (f"{r['mem_ratio_plain']:>10.2f}x" if has_plain else "")
                     + f"{r['hwm_mb']:>9.0f}")
    target_memory = defaults["target_memory"]
    for mode in ("smd_flex", "smd_tiled"):  # the memory paths (no T x T mask) `smdctl learn` runs
        picked = [r for r in rows if r["mode"] == mode]
        if not picked:
            continue
        name = mode[4:]
        worst_t = max(picked, key=lambda r: r["time_ratio"])
        worst_m = max(picked, key=lambda r: r["mem_ratio"])
        verdict = "PASS" if worst_t["time_ratio"] <= TARGET_TIME else "MISS"
        print_fn(f"target smd ({name}) step time <= {TARGET_TIME}x dense: worst {worst_t['time_ratio']:.2f}x at "
                 f"T={worst_t['T']} -> {verdict}")
        verdict = "PASS" if worst_m["mem_ratio"] <= target_memory else "MISS"
        print_fn(f"target smd ({name}) peak memory <= {target_memory}x dense: worst {worst_m['mem_ratio']:.2f}x at "
                 f"T={worst_m['T']} -> {verdict}")
        if has_plain:
            worst_p = max(picked, key=lambda r: r["mem_ratio_plain"])
            verdict = "PASS" if worst_p["mem_ratio_plain"] <= target_memory else "MISS"
            print_fn(f"target smd ({name}) peak memory <= {target_memory}x plain fwd-bwd: worst "
                     f"{worst_p['mem_ratio_plain']:.2f}x at T={worst_p['T']} -> {verdict}")
    return rows



# ------------------------------------------------------------------------------------------ LoRA (issue 43)
class _LoraLearner(_Learner):
    """`_Learner` with PEFT's LoRA adapters (rank `lora_rank`, alpha 2 x rank, every linear layer of the decoder:
    `learner.lora`'s defaults, stages/learner/lora.py) on the frozen model, and AdamW over the adapters only, as
    `smdctl learn` builds them under `learner.lora`. `lora_rank` None: full fine-tuning, as `_Learner`.
    `gradient_checkpointing`: every decoder layer checkpointed as under `learner.gradient_checkpointing` (the learner
    stage's `enable_layer_checkpointing` on the model it trains, after the adapters are in place; each step inside
    `checkpointed_layers`)."""

    def __init__(self, T: int, block_size: int, threads: int, shape: str, lora_rank: int | None,
                 chunk_tokens: int | None = None, device: str = "cpu", dtype: str = "float32",
                 gradient_checkpointing: bool = False):
        import torch

        super().__init__(T, block_size, threads, shape, chunk_tokens, device=device, dtype=dtype)
        if lora_rank:
            from schemas.params.learner import LoraParams
            from stages.learner.lora import lora_config

            peft = __import__("peft")
            config = lora_config(LoraParams(rank=lora_rank, alpha=2.0 * lora_rank))
            self.peft_model = peft.get_peft_model(self.model, config, autocast_adapter_dtype=False).eval()
            self.model = self.peft_model.get_base_model()
        self.gradient_checkpointing = gradient_checkpointing
        if gradient_checkpointing:
            from stages.learner.shadow_attention import enable_layer_checkpointing

            enable_layer_checkpointing(self.model)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=1e-6)

    def step(self, mode: str) -> None:
        """`_Learner.step`, with checkpointing inside `checkpointed_layers` as the learner stage's micro-step (which
        leaves backward outside it: the same, since a checkpoint's recomputation does not read the flags)."""
        from stages.learner.shadow_attention import checkpointed_layers

        with checkpointed_layers(self.model) if self.gradient_checkpointing else contextlib.nullcontext():
            super().step(mode)


def _saved_for_backward(model, run: Callable[[], None]) -> tuple[float, float]:
    """`run()` (a step) under autograd's saved-tensor hooks: MiB autograd keeps for backward (distinct storages,
    parameters excluded), all of it and the part first saved inside LoRA's adapter branches (lora_A / lora_B /
    lora_dropout; a frozen base linear keeps no input, so its adapter keeps it). Tensors inside a checkpointed
    layer are recomputed, not kept: not counted (nor the layer inputs the checkpoints hold)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    adapter: set[int] = set()
    depth = [0]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
            if depth[0]:
                adapter.add(storage.data_ptr())
        return t

    handles = []
    for name, module in model.named_modules():
        if name.split(".")[-2:-1] in (["lora_A"], ["lora_B"], ["lora_dropout"]):
            handles.append(module.register_forward_pre_hook(lambda *a: depth.__setitem__(0, depth[0] + 1)))
            handles.append(module.register_forward_hook(lambda *a: depth.__setitem__(0, depth[0] - 1)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    return sum(saved.values()) / 2**20, sum(saved[k] for k in adapter) / 2**20


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _child_lora(mode: str, T: int, block_size: int, threads: int, shape: str, lora_rank: int | None, rounds: int,
                chunk_tokens: int | None = None, device: str = "cpu", dtype: str = "float32",
                gradient_checkpointing: bool = False) -> dict[str, Any]:
    """One learner (`mode`, full fine-tuning or LoRA of `lora_rank`) alone in this process: a warm-up step (AdamW
    allocates its state), one step whose memory is measured, then `rounds` timed steps (median). Memory itemized:
    weights, trainable parameters (their gradients are as large), AdamW state, the step's working memory (peak
    minus before it: activations, gradients, temporaries), and the process's peak (CPU: VmHWM, the runtime
    included; CUDA: the peak allocation); the warm-up step counts what autograd saves for backward
    (`_saved_for_backward`). `checkpointing`: whether the model's layers are checkpointed (`gradient_checkpointing`)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    learner = _LoraLearner(T, block_size, threads, shape, lora_rank, chunk_tokens, device=device, dtype=dtype,
                           gradient_checkpointing=gradient_checkpointing)
    params = list(learner.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    saved_mb, adapter_saved_mb = _saved_for_backward(learner.model, lambda: learner.step(mode))
    optimizer = [t for state in learner.opt.state.values() for t in state.values() if torch.is_tensor(t)]
    base, can_reset = _start_peak(device)
    learner.step(mode)
    if cuda:
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        working = peak - base
    else:
        peak = _status_kib("VmHWM") * 1024
        working = peak - base if can_reset else float("nan")
    times = []
    for _ in range(max(rounds, 1)):
        t0 = time.perf_counter()
        learner.step(mode)
        _sync(device)
        times.append(time.perf_counter() - t0)
    mib = 2.0**20
    return {"step_s": statistics.median(times), "times": times, "weights_mb": _bytes(params) / mib,
            "trainable": sum(p.numel() for p in trainable), "trainable_mb": _bytes(trainable) / mib,
            "optimizer_mb": _bytes(optimizer) / mib, "working_mb": working / mib, "peak_mb": peak / mib,
            "saved_mb": saved_mb, "adapter_saved_mb": adapter_saved_mb,
            "checkpointing": bool(learner.model.is_gradient_checkpointing)}


def run_lora_bench(shape: str, lora_rank: int, lengths=None, rounds: int = 3, block_size: int = 128, threads: int = 1,
                   timeout_s: int = 3600, print_fn=print, chunk_tokens: int | None = None, device: str = "cpu",
                   dtype: str = "float32", gradient_checkpointing: bool = False) -> list[dict[str, Any]]:
    """`smdctl bench learner --lora-rank R`: one smd learner step (the shadow-masked policy with gradient and the
    dense teacher, as `smdctl learn` runs it: sdpa on the CPU, flex on CUDA) with full fine-tuning and with LoRA of
    rank R, per T each in its own process (CPU) or one after the other (CUDA): step time, and memory itemized
    (`_child_lora`). Target (issue 43): LoRA's peak <= 0.5 x full fine-tuning's at the SmolLM2 shape.
    `gradient_checkpointing`: both learners with every decoder layer checkpointed (`learner.gradient_checkpointing`),
    rows labelled "+ckpt"."""
    from schemas.errors import SmdInputError
    from stages.common.model import DTYPES, resolve_device

    where = resolve_device(device)
    if dtype not in DTYPES:
        raise SmdInputError(f"bench learner: dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if shape not in SHAPES and not is_model_dir(shape):
        raise SmdInputError(f"bench learner: unknown shape {shape!r}; choose from {', '.join(SHAPES)} or give a model "
                            "directory (--model)")
    if lora_rank < 1:
        raise SmdInputError(f"bench learner: --lora-rank {lora_rank}: must be >= 1")
    defaults = MODEL_DEFAULTS if is_model_dir(shape) else SHAPE_DEFAULTS[shape]
    lengths = list(lengths or defaults["lengths"])
    if not lengths or min(lengths) < 16:
        raise SmdInputError("bench learner: lengths must be >= 16 tokens")
    mode = "smd_flex" if where.type == "cuda" else "smd_sdpa"
    peak_what = "peak CUDA allocation" if where.type == "cuda" else "peak RSS of the process (runtime included)"
    ckpt = " +ckpt" if gradient_checkpointing else ""
    names = [(f"full{ckpt}", None), (f"lora r{lora_rank}{ckpt}", lora_rank)]
    w = max(14, max(len(n) for n, _ in names) + 2)
    print_fn(f"bench learner, LoRA rank {lora_rank} (alpha {2 * lora_rank}, all linear layers) vs full fine-tuning"
             + (", both with gradient checkpointing of every decoder layer (+ckpt: learner.gradient_checkpointing; "
                "the teacher then runs as its own dense pass, as in the learner)" if gradient_checkpointing else "")
             + ": "
             f"{describe_shape(shape)}, {weights_note(shape)}1 sequence of T tokens (prompt 3T/4), SnapKV-like masks "
             f"keep 0.5, learner {LABELS[mode]} (teacher + masked policy), {dtype} on {where}, {threads or 'default'} "
             f"thread(s). Step = forward + backward + AdamW, median of {rounds} after a warm-up; work = the step's "
             f"working memory (activations, gradients); held = weights + AdamW + work; peak = {peak_what}")
    print_fn(f"{'T':>5}  {'learner':<{w}}{'trainable':>12}{'weights':>9}{'AdamW':>9}{'work':>9}{'held':>9}{'peak MiB':>10}"
             f"{'x full':>8}{'step s':>8}{'x full':>8}")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    rows: list[dict[str, Any]] = []
    for T in lengths:
        per: dict[str, dict[str, Any]] = {}
        for name, rank in names:
            args = {"kind": "lora", "mode": mode, "T": T, "block_size": block_size, "threads": threads,
                    "shape": shape, "lora_rank": rank, "rounds": rounds, "chunk_tokens": chunk_tokens,
                    "device": str(where), "dtype": dtype, "gradient_checkpointing": gradient_checkpointing}
            if where.type == "cuda":
                out, err = _child_lora(mode, T, block_size, 0, shape, rank, rounds, chunk_tokens, str(where), dtype,
                                       gradient_checkpointing), ""
                gc.collect()
                __import__("torch").cuda.empty_cache()
            else:
                out, err = _run_child(args, env, timeout_s)
            if out is None:
                print_fn(f"{T:>5}  {name:<{w}} failed: {err}")
                continue
            per[name] = {"T": T, "learner": name, "lora_rank": rank, **out}
        full = per.get(names[0][0])
        for name, r in per.items():
            r["mem_ratio"] = _ratio(r["peak_mb"], full["peak_mb"]) if full else float("nan")
            r["time_ratio"] = _ratio(r["step_s"], full["step_s"]) if full else float("nan")
            r["held_mb"] = r["weights_mb"] + r["optimizer_mb"] + r["working_mb"]
            rows.append(r)
            print_fn(f"{T:>5}  {name:<{w}}{r['trainable']:>12,}{r['weights_mb']:>9.0f}{r['optimizer_mb']:>9.1f}"
                     f"{r['working_mb']:>9.0f}{r['held_mb']:>9.0f}{r['peak_mb']:>10.0f}{r['mem_ratio']:>7.2f}x{r['step_s']:>8.3f}"
                     f"{r['time_ratio']:>7.2f}x")
    picked = [r for r in rows if r["lora_rank"]]
    if picked:
        worst = max(picked, key=lambda r: r["mem_ratio"])
        verdict = "PASS" if worst["mem_ratio"] <= LORA_TARGET_MEMORY else "MISS"
        print_fn(f"target LoRA peak memory <= {LORA_TARGET_MEMORY}x full fine-tuning{ckpt}: worst "
                 f"{worst['mem_ratio']:.2f}x at T={worst['T']} -> {verdict}")
    if rows:
        print_fn("saved for backward by autograd in the warm-up step (MiB, distinct tensors, parameters excluded; "
                 "inside checkpointed layers recomputed, not kept): all / in LoRA's adapter branches")
        for r in rows:
            print_fn(f"{r['T']:>5}  {r['learner']:<{w}}{r['saved_mb']:>9.0f}{r['adapter_saved_mb']:>9.0f}")
    return rows


LORA_TARGET_MEMORY = 0.5

if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    extra = {"shape": args.get("shape", "tiny"), "chunk_tokens": args.get("chunk_tokens")}
    if args["kind"] == "lora":
        out = _child_lora(args["mode"], args["T"], args["block_size"], args["threads"], args["shape"],
                          args["lora_rank"], args["rounds"], args.get("chunk_tokens"), args["device"], args["dtype"],
                          args.get("gradient_checkpointing", False))
    elif args["kind"] == "time":
        out = _child_time(args["modes"], args["T"], args["rounds"], args["block_size"], args["threads"], **extra)
    else:
        out = _child_memory(args["mode"], args["T"], args["block_size"], args["threads"], **extra)
    print(json.dumps(out))
