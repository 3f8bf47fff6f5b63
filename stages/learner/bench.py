"""`smdctl bench learner`: one learner step (forward + backward + AdamW step) of the tiny default model at
several sequence lengths, side by side:

  dense        the naive learner: dense causal forward with gradient (SDPA, flash kernel), GRPO loss
  smd flex     SMD as `smdctl learn` runs it: the prefill rows (identical for both policies) once, then
               the response rows densely under no_grad (teacher) and shadow-masked with gradient through
               FlexAttention (block mask from evict_at, built every step); full-vocabulary KL
  smd sdpa     the same on the reference backend: an explicit [B, H, T, T] boolean mask per layer
  smd gather   SMD as a KV-eviction learner would do it: per query block, physically gather the keys/values
               any query of the block still sees (copies kept for backward), then masked attention (whole
               sequence; dense teacher as a separate no_grad pass first)

Each configuration runs in its own subprocess (peak memory is per process on a CPU): a warm-up step at a
short length (compiles FlexAttention), then `steps` timed steps at T. Peak memory is the step's working
memory, measured on one more step after the timed ones: peak resident set (VmHWM, reset through
/proc/self/clear_refs) minus the resident set just before that step (model, optimizer state, inputs),
with glibc set to mmap every allocation >= 64 KiB (mallopt) so that the resident set follows live memory
(the timed steps run with the default allocator).

Masks are synthetic SnapKV-like schedules (`stages.compaction.synthetic`, keep ratio 0.5) over a
prompt of 3/4 T and a response of T/4 (the learner's loss covers the response). Random weights.
Times are CPU times on a shared machine: ratios are what count; on CPU FlexAttention has no fused
backward, so the smd flex step uses the block-sparse torch backward of `flex_backend`.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("dense", "smd_flex", "smd_sdpa", "smd_gather")
LABELS = {"dense": "dense", "smd_flex": "smd flex", "smd_sdpa": "smd sdpa (ref)", "smd_gather": "smd gather (KV slicing)"}
TARGET_TIME = 1.4
TARGET_MEMORY = 1.05
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


def _setup(T: int, seed: int = 0) -> dict[str, Any]:
    import numpy as np
    import torch

    from stages.compaction.synthetic import eviction_config, synthetic_evict_at
    from stages.learner.shadow_attention import pad_evict_at

    P, R = (3 * T) // 4, T - (3 * T) // 4
    rng = np.random.default_rng(seed)
    ev = synthetic_evict_at("snapkv", T, P, 4, 2, eviction_config("snapkv", 0.5), rng).astype(np.int64)
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(4, 250, (1, T), generator=g),
        "evict_at": pad_evict_at([torch.from_numpy(ev)], T),
        "prompt_lens": [P],
        "resp_lens": [R],
        "advantages": torch.tensor([1.0]),
    }


def _child(mode: str, T: int, steps: int, block_size: int, warmup_T: int, threads: int) -> dict[str, Any]:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from transformers import AttentionInterface

    from schemas.params.learner import LearnerParams
    from schemas.params.model import TinyModelParams
    from stages.learner.flex_backend import build_block_masks
    from stages.learner.objectives import objective_kwargs, objective_loss, token_logprobs
    from stages.learner.shadow_attention import response_logits, response_logits_with_teacher
    from stages.model import build_tiny_model
    from stages.vocab import tiny_vocabulary

    AttentionInterface.register(GATHER_ATTENTION, gather_attention)
    torch.manual_seed(0)
    shape = TinyModelParams().model_copy(update={"max_position_embeddings": max(T, 8192)})
    model = build_tiny_model(shape, vocab_size=len(tiny_vocabulary()), seed=0)
    model.config._attn_implementation = "sdpa"
    model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    kw = objective_kwargs(LearnerParams(), 1.0)
    num_q = model.config.num_attention_heads

    def logits(b: dict, masked: bool):
        if not masked:
            return response_logits(model, b["ids"], None, b["prompt_lens"], b["resp_lens"])
        if mode == "smd_gather":
            prev = model.config._attn_implementation
            model.config._attn_implementation = GATHER_ATTENTION
            try:
                return _gather_logits(model, b, block_size)
            finally:
                model.config._attn_implementation = prev
        backend = "flex" if mode == "smd_flex" else "sdpa"
        extra = {"smd_block_masks": build_block_masks(b["evict_at"], num_q, block_size)} if backend == "flex" else {}
        return response_logits(model, b["ids"], b["evict_at"], b["prompt_lens"], b["resp_lens"], backend, **extra)

    def step(b: dict) -> None:
        masked = mode != "dense"
        if mode in ("smd_flex", "smd_sdpa"):  # as the learner: teacher and policy share the prefill rows
            sel, dsel, targets, valid = response_logits_with_teacher(
                model, b["ids"], b["evict_at"], b["prompt_lens"], b["resp_lens"], mode[4:], block_size)
        elif masked:  # the gathering learner: separate teacher pass first
            with torch.no_grad():
                dsel, _, _ = logits(b, False)
            sel, targets, valid = logits(b, True)
        else:
            sel, targets, valid = logits(b, False)
        logp = token_logprobs(sel, targets).masked_fill(~valid, 0.0)
        if masked:
            loss, _ = objective_loss("smd", advantages=b["advantages"], mask=valid, rollout_logp=b["rollout"],
                                     masked_logp=logp, masked_logits=sel, dense_logits=dsel, **kw)
        else:
            loss, _ = objective_loss("dense", advantages=b["advantages"], mask=valid, rollout_logp=b["rollout"],
                                     dense_logp=logp, **kw)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def prepared(length: int) -> dict:
        b = _setup(length)
        with torch.no_grad():
            sel, targets, valid = response_logits(model, b["ids"], None, b["prompt_lens"], b["resp_lens"])
            b["rollout"] = token_logprobs(sel, targets).masked_fill(~valid, 0.0)
        return b

    if 0 < warmup_T < T:
        step(prepared(warmup_T))
    batch = prepared(T)
    step(batch)  # compiles FlexAttention (dynamic shapes), warms the kernels, allocates the AdamW state
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    # Memory: one more step with large allocations mmapped (returned to the OS on free), so that the
    # resident set follows live memory; peak over the resident set before the step.
    _malloc_live_tracking()
    gc.collect()
    can_reset = _reset_peak()
    base = _status_kib("VmRSS")
    step(batch)
    hwm = _status_kib("VmHWM")
    return {"mode": mode, "T": T, "step_s": statistics.median(times), "times": times,
            "peak_mb": (hwm - base) / 1024 if can_reset else float("nan"), "base_mb": base / 1024,
            "hwm_mb": hwm / 1024}


def _gather_logits(model, b: dict, block_size: int):
    """response_logits through the gathering attention (mirrors shadow_attention.response_logits)."""
    import torch

    from stages.learner.shadow_attention import response_index

    ids = b["ids"]
    B, T = ids.shape
    start = min(b["prompt_lens"]) - 1
    position_ids = torch.arange(T).unsqueeze(0).expand(B, T)
    out = model(input_ids=ids, position_ids=position_ids, use_cache=False, logits_to_keep=T - start,
                smd_evict_at=b["evict_at"], smd_gather_block=block_size).logits
    idx, valid = response_index(b["prompt_lens"], b["resp_lens"], offset=start)
    sel = torch.gather(out, 1, idx.unsqueeze(-1).expand(-1, -1, out.shape[-1]))
    targets = torch.gather(ids, 1, (idx + start + 1).clamp(max=T - 1))
    return sel, targets, valid


def run_learner_bench(lengths=(512, 2048, 4096), modes=MODES, steps: int = 2, block_size: int = 128,
                      warmup_T: int = 0, threads: int = 1, timeout_s: int = 600,
                      print_fn=print) -> list[dict[str, Any]]:
    """Run every (T, mode) in a subprocess; print the table and the targets; return the rows."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    rows: list[dict[str, Any]] = []
    print_fn(f"bench learner: tiny default model (4 layers, 4 q / 2 kv heads, head_dim 32), 1 sequence of T tokens "
             f"(prompt 3T/4, response T/4), SnapKV-like masks keep 0.5, flex block {block_size}, "
             f"median of {steps} steps after a warm-up step, {threads or 'default'} torch thread(s), one subprocess per config")
    header = f"{'T':>5}  {'learner':<24}{'step s':>8}{'x dense':>9}{'peak MiB':>10}{'x dense':>9}{'RSS MiB':>9}"
    print_fn(header)
    for T in lengths:
        dense = None
        for mode in modes:
            cmd = [sys.executable, "-m", "stages.learner.bench", json.dumps(
                {"mode": mode, "T": T, "steps": steps, "block_size": block_size, "warmup_T": warmup_T,
                 "threads": threads})]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
                print_fn(f"{T:>5}  {LABELS[mode]:<24} failed: {tail[0][:100]}")
                continue
            r = json.loads(lines[-1])
            if mode == "dense":
                dense = r
            r["time_ratio"] = r["step_s"] / dense["step_s"] if dense else float("nan")
            r["mem_ratio"] = r["peak_mb"] / dense["peak_mb"] if dense and dense["peak_mb"] > 0 else float("nan")
            rows.append(r)
            print_fn(f"{T:>5}  {LABELS[mode]:<24}{r['step_s']:>8.3f}{r['time_ratio']:>8.2f}x{r['peak_mb']:>10.1f}"
                     f"{r['mem_ratio']:>8.2f}x{r['hwm_mb']:>9.0f}")
    flex = [r for r in rows if r["mode"] == "smd_flex"]
    if flex:
        worst_t = max(flex, key=lambda r: r["time_ratio"])
        worst_m = max(flex, key=lambda r: r["mem_ratio"])
        verdict = "PASS" if worst_t["time_ratio"] <= TARGET_TIME else "MISS"
        print_fn(f"target smd step time <= {TARGET_TIME}x dense: worst {worst_t['time_ratio']:.2f}x at "
                 f"T={worst_t['T']} -> {verdict}")
        verdict = "PASS" if worst_m["mem_ratio"] <= TARGET_MEMORY else "MISS"
        print_fn(f"target smd (flex) peak memory <= {TARGET_MEMORY}x dense: worst {worst_m['mem_ratio']:.2f}x at "
                 f"T={worst_m['T']} -> {verdict}")
    return rows


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(_child(args["mode"], args["T"], args["steps"], args["block_size"], args["warmup_T"],
                            args["threads"])))
