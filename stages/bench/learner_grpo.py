"""`smdctl bench learner --model DIR --group-size G`: the learner stage on GRPO's workload, shared prompts against
per-sample prompts (issue 40, docs/design.md §3c and §8).

The workload is an iteration's batch as the SmolLM2 spec makes it by default: `prompts` prompts of about
`prompt_tokens` tokens (lengths spread over the last 8 so that micro-batches pad), `group_size` responses of
`min_response_tokens` (default half) to `response_tokens` tokens each, SnapKV-like shadow masks at keep ratio 0.5 (`stages.bench.synthetic_rollouts`:
each sample its own schedule), random token ids and 0/1 rewards. Written once as a trajectory table and a
compacted mask store, then learned from by `run_learner` itself, once per arm, each in its own process (peak
memory is per process on a CPU) and `repeats` times (the fastest counts):

  smd shared       learner.objective smd (lambda 0.1, the dense teacher of the same weights), shared prompts
  smd token budget the same with micro-batches by a token budget (learner.micro_batch_tokens: whole groups up to
                   `micro_batch_tokens` padded tokens; by default max(micro-batch, G) x (prompt + response tokens),
                   the row-count arm's micro-batch at the longest rows)
  smd per-sample   the same with learner.shared_prompt false: every sample forwards its prompt
  smd packed       smd per-sample with each micro-batch's rows packed into one row (learner.pack: the same rows
                   a micro-batch, no padding; stages/learner/packing.py)
  dense shared     the dense learner (objective dense): no mask, no teacher; the field's anchor
  dense per-sample the same, per sample

Per arm: padded tokens / real tokens of its steps (rows x longest row per micro-batch over prompt + response
tokens: `learner/padded_token_ratio`), the optimizer step's seconds (forward, backward and AdamW: `learner/seconds_per_step`), the parity pass's
(a no-grad scoring of every row), the whole learn call, and memory, itemized from the resident set measured at the
learner's own stages (glibc set to release freed memory, as `stages.bench.learner` does): the process before
the learner (Python, torch, DeepSpeed imported), the policy loaded (weights), the DeepSpeed engine built
(optimizer state and DeepSpeed's buffers), and the peak over the parity pass and the step (activations, logits,
the teacher's pass and the gradients). The synthetic rollout log-probs are not the model's, so the parity gate is
opened (learner.parity_tol 1e9); everything else runs as `smdctl learn` runs it.

`profile=True` (`--profile`) runs every arm once more after the timed runs, untimed, with the learner's phases
clocked (the parity pass; in the step: micro-batch building, the forward, the lm head's scores, the backward,
AdamW through DeepSpeed's `engine.step`) and the whole learn call under `torch.profiler`: its top operators by
self CPU time are printed per arm.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from stages.bench.learner import _status_kib
from stages.bench.profiling import log_operators, top_operators

# the learner's phases the profile clocks: train.py's module-level name -> phase
PHASES: dict[str, str] = {
    "build_micro_batch": "micro-batch",
    "shared_prompt_hidden": "forward", "response_hidden_with_teacher": "forward", "micro_batch_hidden": "forward",
    "packed_hidden_with_teacher": "forward",
    "forward_logp": "forward", "chunked_token_scores": "lm head",
}

# (label, objective, shared prompts, micro-batches by a token budget, packed rows)
ARMS: tuple[tuple[str, str, bool, bool, bool], ...] = (
    ("smd shared", "smd", True, False, False),
    ("smd token budget", "smd", True, True, False),
    ("smd per-sample", "smd", False, False, False),
    ("smd packed", "smd", False, False, True),
    ("dense shared", "dense", True, False, False),
    ("dense per-sample", "dense", False, False, False),
)


def dual_pass_floor(teacher_tokens: int, step_tokens: int) -> float:
    """smd's step time over the dense learner's at best: the dense learner's forward and backward over
    `step_tokens` (a backward costs two forwards: 3 forward-equivalents) plus the dense teacher's no-grad forward
    over `teacher_tokens` (the responses; the prompt's pass is shared with the policy's), by FLOPs (issue 55)."""
    return 1.0 + teacher_tokens / (3.0 * step_tokens)


def grpo_workload(model_dir: Path, out: Path, prompts: int, group_size: int, prompt_tokens: int,
                  response_tokens: int, keep_ratio: float = 0.5, seed: int = 0,
                  min_response_tokens: int | None = None) -> tuple[Path, Path, dict[str, int]]:
    """Write the bench's iteration (trajectories.arrow + compacted masks.zarr) under `out`; returns their paths
    and the token counts (real tokens per sample, distinct prompt tokens, response tokens). Response lengths are
    uniform in [min_response_tokens (default response_tokens // 2, at least 1), response_tokens]."""
    from transformers import AutoConfig

    from schemas.params.compaction import CompactionParams
    from schemas.params.rollout import EvictionParams
    from stages.bench.synthetic_rollouts import synthetic_evict_at, write_synthetic_inputs
    from stages.compaction import run_compaction

    cfg = AutoConfig.from_pretrained(model_dir)
    layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    eviction = EvictionParams(policy="snapkv", keep_ratio=keep_ratio).model_dump()
    rng = np.random.default_rng(seed)
    table: list[dict[str, Any]] = []
    evs: list[np.ndarray] = []
    distinct = 0
    for p in range(prompts):
        P = max(2, prompt_tokens - int(rng.integers(0, 8)))
        distinct += P
        prompt = rng.integers(4, cfg.vocab_size - 1, size=P).tolist()
        for g in range(group_size):
            R = int(rng.integers(max(1, min_response_tokens or response_tokens // 2), response_tokens + 1))
            i = len(table)
            evs.append(synthetic_evict_at("snapkv", P + R, P, layers, kv_heads, eviction, rng))
            table.append({
                "trajectory_id": f"traj-{i:05d}", "prompt_id": f"prompt-{p:05d}", "group_index": g, "iteration": 1,
                "task": "synthetic", "prompt_token_ids": prompt,
                "response_token_ids": rng.integers(4, cfg.vocab_size - 1, size=R).tolist(), "response_text": "",
                "rollout_logprobs": [-1.0] * R, "reward": float(rng.integers(0, 2)), "finish_reason": "length",
                "eviction_policy": "snapkv", "keep_ratio": keep_ratio, "max_tokens": None,
                "kv_peak_tokens": P + R, "kv_dense_tokens": P + R, "mask_row": i,
            })
    lengths = [len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in table]
    shard = {"evict_at": np.concatenate(evs), "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
             "mask_row": np.arange(len(table), dtype=np.int64),
             "prompt_len": np.asarray([len(r["prompt_token_ids"]) for r in table], dtype=np.int32)}
    traj, raw = write_synthetic_inputs(out / "rollout", table, [shard], eviction, layers, kv_heads)
    masks = run_compaction(CompactionParams(), traj, raw, out / "compact" / "masks.zarr")["masks"]
    counts = {"tokens": int(sum(lengths)), "distinct_prompt_tokens": distinct,
              "response_tokens": int(sum(len(r["response_token_ids"]) for r in table))}
    return traj, masks, counts


def _rss_mb() -> float:
    return _status_kib("VmRSS") / 1024.0


def _hwm_mb() -> float:
    return _status_kib("VmHWM") / 1024.0


def arm_params(spec: dict[str, Any], resume: bool = False):
    """The params every arm learns with: the arm's objective, sharing and micro-batch; the parity gate opened
    (the synthetic log-probs are not the model's); `resume`: learner.resume_optimizer."""
    from schemas.params import load_params

    tokens = spec.get("micro_batch_tokens")
    return load_params(None, [
        f"learner.objective={spec['objective']}", f"learner.shared_prompt={str(spec['shared']).lower()}",
        f"learner.micro_batch_size={spec['micro_batch_size']}", "learner.parity_tol=1000000000.0",
        f"learner.micro_batch_tokens={tokens if tokens else 'null'}", f"learner.pack={str(spec.get('pack', False)).lower()}",
        f"learner.resume_optimizer={str(resume).lower()}", "learner.lr=1e-7",
        f"learner.attention_backend={spec['backend']}", "rollout.eviction.policy=snapkv",
        f"rollout.temperature={spec['temperature']}",
    ])


def arm_main(spec_json: str) -> None:
    """One arm in this process (the bench's subprocess): learn once from the workload, print one JSON line."""
    from stages.bench.learner import _malloc_live_tracking, _reset_peak

    spec = json.loads(spec_json)
    _malloc_live_tracking()
    import torch

    import stages.learner.train as train

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    marks: dict[str, float] = {"start": _rss_mb()}
    load_policy, make_engine = train.load_policy, train.make_engine

    def loaded(*args, **kwargs):
        model = load_policy(*args, **kwargs)
        marks.setdefault("policy", _rss_mb())
        return model

    def engine(*args, **kwargs):
        out = make_engine(*args, **kwargs)
        marks["engine"] = _rss_mb()
        _reset_peak()  # the peak from here on: the parity pass and the optimizer step
        return out

    train.load_policy, train.make_engine = loaded, engine
    clock: dict[str, float] = {}
    profiler = None
    if spec.get("profile"):
        inside: list[str] = []  # phases open now: the step's parts count inside it, but once each (no nesting)

        def timed(phase: str, fn):
            def wrapper(*args, **kwargs):
                if [p for p in inside if p != "step"]:
                    return fn(*args, **kwargs)
                inside.append(phase)
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    clock[phase] = clock.get(phase, 0.0) + time.perf_counter() - t0
                    inside.pop()
            return wrapper

        for name, phase in PHASES.items():
            setattr(train, name, timed(phase, getattr(train, name)))
        train.parity_pass = timed("parity pass", train.parity_pass)
        train.train_step = timed("step", train.train_step)

        def engine_timed(*args, **kwargs):
            out = engine(*args, **kwargs)
            eng = out[0] if isinstance(out, tuple) else out
            eng.backward = timed("backward", eng.backward)
            eng.step = timed("optimizer", eng.step)
            return out

        train.make_engine = engine_timed
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    params = arm_params(spec)
    with tempfile.TemporaryDirectory() as tmp, profiler or contextlib.nullcontext():
        out = train.run_learner(params, 1, Path(spec["model"]), spec["trajectories"], spec["masks"],
                                Path(tmp) / "policy")
        details = json.loads(out["details"].read_text())
    marks["peak"] = _hwm_mb()
    top = top_operators(profiler, spec.get("top", 12)) if profiler is not None else []
    print("SMD_BENCH " + json.dumps({
        "step_s": details["learner/seconds_per_step"], "parity_s": details.get("learner/parity_seconds", 0.0),
        "padded_ratio": details.get("learner/padded_token_ratio", float("nan")),
        "learn_s": details["learner/seconds"], **{f"rss_{k}_mb": v for k, v in marks.items()},
        "phases": clock, "top_ops": top,
    }), flush=True)


# torch.profiler's memory categories (torch.profiler._memory_profiler.Category), as the rows of the itemized peak
MEMORY_CATEGORIES: dict[str, str] = {
    "PARAMETER": "weights", "OPTIMIZER_STATE": "optimizer state", "GRADIENT": "gradients",
    "ACTIVATION": "activations (saved for backward)", "AUTOGRAD_DETAIL": "autograd detail",
    "TEMPORARY": "temporaries", "INPUT": "inputs", None: "unattributed",
}


def categories_at_peak(sizes: list[list[int]], names: list[str | None]) -> dict[str, Any]:
    """The moment torch's allocated bytes peak in a memory timeline (`MemoryProfileTimeline._coalesce_timeline`:
    per moment, a leading 0 then bytes per category in `names`' order): that moment's bytes per category, and each
    category's own largest bytes over the run. Pure, so that it can be checked by hand."""
    arr = np.asarray(sizes, dtype=np.int64)[:, 1:]
    total = arr.sum(axis=1)
    i = int(total.argmax())
    return {"peak_bytes": int(total[i]), "at_peak": {MEMORY_CATEGORIES.get(n, str(n)): int(arr[i, j]) for j, n in enumerate(names)},
            "category_max": {MEMORY_CATEGORIES.get(n, str(n)): int(arr[:, j].max()) for j, n in enumerate(names)}}


def memory_arm_main(spec_json: str) -> None:
    """`--memory`: one arm's resumed learn call itemized (the bench's subprocess; prints one JSON line).

    A chain's learn call from iteration 2 on resumes AdamW's moments, so they are live through the whole step
    (docs/design.md §3c). This runs a first learn call (fresh optimizer) that writes a policy and its trainer
    state, then from it a resumed call (`learner.resume_optimizer` true) whose resident-set peak is measured
    (glibc set to release freed memory, the peak reset at its start), then the same resumed call once more under
    torch.profiler with memory profiling: its categorized timeline (torch.profiler's memory profiler: weights,
    optimizer state, gradients, activations saved for backward, autograd detail, temporaries, inputs) at the
    moment torch's allocated bytes peak. What the resident set holds beyond torch's allocation (Python, torch's
    and DeepSpeed's runtime, the allocator's slack) is the difference."""
    import gc

    from stages.bench.learner import _malloc_live_tracking, _reset_peak

    spec = json.loads(spec_json)
    _malloc_live_tracking()
    import torch
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    import stages.learner.train as train

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])

    def learn(iteration: int, policy: Path, out: Path, resume: bool) -> dict[str, Any]:
        res = train.run_learner(arm_params(spec, resume), iteration, policy, spec["trajectories"], spec["masks"], out)
        return json.loads(res["details"].read_text())

    def settle() -> float:
        gc.collect()
        _malloc_live_tracking()
        return _rss_mb()

    with tempfile.TemporaryDirectory() as tmp:
        first = Path(tmp) / "policy-1"
        learn(1, Path(spec["model"]), first, resume=False)
        before = settle()
        _reset_peak()
        details = learn(2, first, Path(tmp) / "policy-2", resume=True)
        peak = _hwm_mb()
        after = settle()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    record_shapes=True, with_stack=True) as prof:
            learn(2, first, Path(tmp) / "policy-3", resume=True)
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    names = [c.name if c is not None else None for c in sorted(_CATEGORY_TO_INDEX, key=_CATEGORY_TO_INDEX.get)]
    print("SMD_BENCH " + json.dumps({
        "rss_before_mb": before, "rss_peak_mb": peak, "rss_after_mb": after,
        "resumed": bool(details["learner/resumed_optimizer"]),
        **categories_at_peak(sizes, names)}), flush=True)


def _run_arm(spec: dict[str, Any], cores: str | None) -> dict[str, Any]:
    main = "memory_arm_main" if spec.get("memory") else "arm_main"
    cmd = [sys.executable, "-c", f"from stages.bench.learner_grpo import {main}; {main}({json.dumps(json.dumps(spec))})"]
    if cores:
        cmd = ["taskset", "-c", cores, *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"] or os.cpu_count())}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("SMD_BENCH "):
            return json.loads(line[len("SMD_BENCH "):])
    raise RuntimeError(f"bench arm {spec['objective']} shared={spec['shared']} failed:\n{proc.stderr[-3000:]}")


def bench_arms(micro_batch_size: int, shared_micro_batch_size: int | None,
               arms: list[str] | None = None) -> list[tuple[str, str, bool, int, bool, bool]]:
    """(label, objective, shared, micro-batch rows, token budget, packed) of every arm `arms` names (None: all). With
    `shared_micro_batch_size` other than `micro_batch_size` the shared row-count arms run at both sizes, those at
    the other size labelled "... mb N" (several groups a micro-batch); the token-budget arm reads no row count."""
    out = []
    for label, objective, shared, tokens, pack in ARMS:
        sizes = [micro_batch_size]
        if shared and not tokens and shared_micro_batch_size not in (None, micro_batch_size):
            sizes.append(shared_micro_batch_size)
        for size in sizes:
            name = label if size == micro_batch_size else f"{label} mb {size}"
            if arms is None or name in arms or label in arms:
                out.append((name, objective, shared, size, tokens, pack))
    unknown = set(arms or ()) - {a[0] for a in out} - {a[0] for a in ARMS}
    if unknown or not out:
        from schemas.errors import SmdInputError

        raise SmdInputError(f"--arms: {', '.join(sorted(unknown)) or 'none chosen'}; the arms are "
                            f"{', '.join(a[0] for a in ARMS)} (and '<arm> mb N' with --shared-micro-batch-size N)")
    return out


def bench_learner_grpo(model_dir: Path, group_size: int = 8, prompts: int = 16, prompt_tokens: int = 141,
                       response_tokens: int = 16, micro_batch_size: int = 8, repeats: int = 2, threads: int = 1,
                       cores: str | None = None, backend: str = "sdpa", arms: list[str] | None = None,
                       temperature: float = 0.7, profile: bool = False, shared_micro_batch_size: int | None = None,
                       memory: bool = False, micro_batch_tokens: int | None = None,
                       min_response_tokens: int | None = None, log=print) -> list[dict[str, Any]]:
    """Run every arm `repeats` times (interleaved), print the table, return its rows; `profile`: then each arm
    once more, untimed, profiled (its phases and top operators printed after the table, and in its row's
    "profile": phases in seconds, top_ops as (name, self CPU seconds, calls)). `shared_micro_batch_size`: the
    shared arms also at this many rows a micro-batch (several groups: their prompts in one call); every shared
    row's "vs per-sample" is against the per-sample arm at `micro_batch_size`. `memory`: then each arm's resumed
    learn call itemized (`memory_arm_main`), printed after the table and in its row's "memory".
    `micro_batch_tokens`: the token-budget arm's learner.micro_batch_tokens (default: max(micro_batch_size,
    group_size) x (prompt_tokens + response_tokens), the row-count arm's micro-batch at the longest rows, at least
    one whole group). `min_response_tokens`: the shortest response (default half the longest; a quarter gives the
    4x spread of issue 55's packing target)."""
    import torch
    from transformers import AutoConfig

    chosen = bench_arms(micro_batch_size, shared_micro_batch_size, arms)
    sizes = {arm[3] for arm in chosen if not arm[4]}
    budget = micro_batch_tokens or max(micro_batch_size, group_size) * (prompt_tokens + response_tokens)
    shared_size_note = f" (mb {shared_micro_batch_size}: the shared arms at that size)" if sizes - {micro_batch_size} else ""
    cfg = AutoConfig.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        traj, masks, counts = grpo_workload(model_dir, Path(tmp), prompts, group_size, prompt_tokens,
                                            response_tokens, min_response_tokens=min_response_tokens)
        n_params = sum(p.numel() for p in _count_model(model_dir).parameters())
        log(f"# learner on GRPO's workload: {model_dir.name} ({n_params / 1e6:.1f}M parameters, {cfg.num_hidden_layers} "
            f"layers), {prompts} prompts x G {group_size}, prompts ~{prompt_tokens} tokens, responses "
            f"{max(1, min_response_tokens or response_tokens // 2)}-{response_tokens}; micro-batch {micro_batch_size}{shared_size_note}"
            f"{f', token budget {budget}' if any(arm[4] for arm in chosen) else ''}; backend {backend}; float32; "
            f"torch {torch.__version__}; "
            f"{threads or 'default'} thread(s); cores {cores or 'any'}; fastest of {repeats}")
        log(f"# tokens: {counts['tokens']} per-sample (prompt + response), "
            f"{counts['distinct_prompt_tokens'] + counts['response_tokens'] + prompts * group_size} shared "
            f"(distinct prompts + responses + each sample's last prompt token)")
        shared_tokens = counts['distinct_prompt_tokens'] + counts['response_tokens']
        log(f"# smd's floor over the dense learner: {dual_pass_floor(counts['response_tokens'], shared_tokens):.3f}x "
            f"shared, {dual_pass_floor(counts['response_tokens'], counts['tokens']):.3f}x per sample (the dense "
            "teacher's forward over the response tokens on top of a forward and backward over the real tokens)")

        def arm_spec(objective: str, shared: bool, size: int, tokens: bool, pack: bool) -> dict[str, Any]:
            return {"model": str(model_dir), "trajectories": str(traj), "masks": str(masks), "objective": objective,
                    "shared": shared, "micro_batch_size": size, "threads": threads, "backend": backend,
                    "temperature": temperature, "micro_batch_tokens": budget if tokens else None, "pack": pack}

        best: dict[str, dict[str, Any]] = {}
        for _ in range(repeats):
            for label, *arm in chosen:
                res = _run_arm(arm_spec(*arm), cores)
                if label not in best or res["step_s"] < best[label]["step_s"]:
                    best[label] = res
        profiles = {}
        for label, *arm in chosen if profile else ():
            profiles[label] = _run_arm({**arm_spec(*arm), "profile": True}, cores)
        itemized = {label: _run_arm({**arm_spec(*arm), "memory": True}, cores)
                    for label, *arm in (chosen if memory else ())}
    weights_mb = n_params * 4 / 2**20
    log(f"# analytic: weights {weights_mb:.0f} MB, gradients {weights_mb:.0f} MB, AdamW moments {2 * weights_mb:.0f} MB "
        f"(sum {4 * weights_mb:.0f} MB)")
    header = ("arm", "step s", "vs per-sample", "padded/real", "parity s", "learn s", "RSS start", "+policy",
              "+engine", "+step peak", "peak MB")
    log("| " + " | ".join(header) + " |")
    log("|" + "---|" * len(header))
    rows = []
    for label, objective, shared, size, tokens, pack in chosen:
        r = best[label]
        twin = best.get(f"{objective} per-sample")
        ratio = f"{twin['step_s'] / r['step_s']:.2f}x" if twin and (shared or pack) else ""
        start, policy = r["rss_start_mb"], r.get("rss_policy_mb", r["rss_start_mb"])
        engine = r.get("rss_engine_mb", policy)
        log(f"| {label} | {r['step_s']:.2f} | {ratio} | {r['padded_ratio']:.2f} | {r['parity_s']:.2f} | "
            f"{r['learn_s']:.1f} | {start:.0f} | "
            f"{policy - start:.0f} | {engine - policy:.0f} | {r['rss_peak_mb'] - engine:.0f} | {r['rss_peak_mb']:.0f} |")
        rows.append({"arm": label, "micro_batch_size": size, "micro_batch_tokens": budget if tokens else None, **r, **({"profile": profiles[label]} if label in profiles else {}),
                     **({"memory": itemized[label]} if label in itemized else {})})
    for label, prof in profiles.items():
        log_profile(label, prof, log)
    if itemized:
        log_memory(itemized, 4 * weights_mb, log)
    return rows


def log_memory(itemized: dict[str, dict[str, Any]], state_mb: float, log=print) -> None:
    """`--memory`'s table: per arm, a resumed learn call's torch allocation at its peak by category, and its
    resident set (before the call: runtime, weights and AdamW's moments; the call's peak); `state_mb` is the
    analytic weights + gradients + AdamW moments."""
    labels = list(itemized)
    mb = 2**20
    log("# a resumed learn call itemized (`--memory`): torch's allocated MB at its peak, by torch.profiler's "
        "memory category; RSS from an unprofiled run of the same call")
    log("| MB | " + " | ".join(labels) + " |")
    log("|---|" + "---|" * len(labels))
    for cat in MEMORY_CATEGORIES.values():
        log(f"| {cat} | " + " | ".join(f"{itemized[a]['at_peak'].get(cat, 0) / mb:.0f}" for a in labels) + " |")
    rows = [("torch allocated at its peak", "{:.0f}", lambda m: m["peak_bytes"] / mb),
            ("RSS before the call", "{:.0f}", lambda m: m["rss_before_mb"]),
            ("RSS peak of the call", "{:.0f}", lambda m: m["rss_peak_mb"]),
            ("RSS peak - torch peak (runtime, allocator)", "{:.0f}", lambda m: m["rss_peak_mb"] - m["peak_bytes"] / mb),
            ("activations + temporaries at the peak", "{:.0f}",
             lambda m: (m["at_peak"]["activations (saved for backward)"] + m["at_peak"]["temporaries"]) / mb),
            ("RSS peak / (weights + gradients + AdamW)", "{:.2f}", lambda m: m["rss_peak_mb"] / state_mb)]
    for name, fmt, fn in rows:
        log(f"| {name} | " + " | ".join(fmt.format(fn(itemized[a])) for a in labels) + " |")


def log_profile(label: str, prof: dict[str, Any], log=print) -> None:
    """One arm's profiled run: the step's phases (seconds; `step other` = the step's time outside them: losses,
    statistics, the parity gate) and the top operators by self CPU time."""
    ph = prof["phases"]
    inner = sum(ph.get(k, 0.0) for k in ("micro-batch", "forward", "lm head", "backward", "optimizer"))
    order = ("parity pass", "micro-batch", "forward", "lm head", "backward", "optimizer")
    log(f"# profile, {label} (one untimed run, profiler on): "
        + ", ".join(f"{k} {ph.get(k, 0.0):.2f} s" for k in order)
        + f", step other {ph.get('step', 0.0) - inner:.2f} s; learn call {prof['learn_s']:.1f} s")
    log_operators(prof["top_ops"], log)


def _count_model(model_dir: Path):
    """The model on the meta device (parameter count only, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
