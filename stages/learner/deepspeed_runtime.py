"""DeepSpeed plumbing of the learner: process group, engine, trainer-state checkpoints.

One process by default: the process group (gloo on CPU, nccl on CUDA) is created by
`stages.common.distributed.init_distributed` with world size 1 on 127.0.0.1 and a free port. Under the `deepspeed` launcher (or `torchrun`) RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT come from the environment and every process runs the same
command; the learner shards the batch by rank.

The optimizer is a plain `torch.optim.AdamW` handed to `deepspeed.initialize` (no DeepSpeed Adam op to
compile); ZeRO stage, gradient clipping and accumulation come from `learner:` params. Gradients are
averaged over processes by DeepSpeed; the learner scales each micro-batch loss so that the sum over all
micro-batches and processes is exactly the objective of the whole mini-batch (see `stages.learner.train`).

Trainer state (`<policy>/trainer_state/`): a DeepSpeed checkpoint (optimizer moments, ZeRO partitions,
step counters) with tag `state`, plus `trainer_state.json` (world size, ZeRO stage, global step, RNG
states live in the checkpoint's client state). The next iteration resumes from it (`resume_mode`): with
the same number of processes and ZeRO stage (or ZeRO stage 0, whose optimizer state is not partitioned)
straight from it; with another process count or ZeRO stage 1 <-> 2 through DeepSpeed's universal
checkpoint (`deepspeed.checkpoint.ds_to_universal`, loaded with the config's `checkpoint.load_universal`),
which re-partitions the optimizer state for the new processes; between ZeRO stage 0 and 1/2 it starts a
fresh optimizer and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import os
import pickle
import random
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from schemas.errors import SmdInputError
from schemas.params.learner import LearnerParams
from stages.common.distributed import DistContext, agree, init_distributed  # noqa: F401 - the learner's process group

TRAINER_STATE = "trainer_state"
STATE_TAG = "state"
STATE_JSON = "trainer_state.json"
UNIVERSAL_TAG = f"{STATE_TAG}_universal"
SAME, UNIVERSAL = "same", "universal"


# DeepSpeed's ZeRO default for both buckets: 5e8 elements (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig:
# `reduce_bucket_size` and `allgather_bucket_size` = pp_int(5e8)), a 2 GiB float32 buffer.
DS_BUCKET_DEFAULT = 500_000_000


def bucket_size(hidden_size: int) -> int:
    """ZeRO's reduce / all-gather bucket (elements) fitted to the model: hidden_size**2, what transformers'
    DeepSpeed integration fills in for `reduce_bucket_size: auto` (integrations/deepspeed.py,
    `trainer_config_finalize`), never above DeepSpeed's default of 5e8."""
    return int(min(DS_BUCKET_DEFAULT, hidden_size * hidden_size))


def zero_stage_for(setting: int | str, world: int, saved_stage: int | None = None) -> int:
    """`learner.zero_stage` resolved. `auto`: the stage of the trainer state being resumed (`saved_stage`), so a
    resume stays bit for bit; else 0 on one process, where ZeRO partitions nothing yet keeps flat fp32 copies of
    the parameters and gradients (docs/design.md §3c), and 1 on several (the optimizer state sharded)."""
    if setting != "auto":
        return int(setting)
    if saved_stage is not None:
        return saved_stage
    return 0 if world == 1 else 1


def ds_config(cfg: LearnerParams, world: int, grad_accum: int, dtype: torch.dtype, cuda: bool,
              load_universal: bool = False, hidden_size: int | None = None) -> dict[str, Any]:
    """The engine's config. On CUDA with `hidden_size` known, ZeRO's buckets are `bucket_size(hidden_size)`
    instead of DeepSpeed's 5e8-element default (issue 32: a 2 GiB float32 buffer on the GPU); the CPU keeps
    DeepSpeed's defaults."""
    zero: dict[str, Any] = {"stage": zero_stage_for(cfg.zero_stage, world)}
    if cuda and hidden_size:
        zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = bucket_size(hidden_size)
    return {
        "checkpoint": {"load_universal": load_universal},
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": cfg.micro_batch_size * grad_accum * world,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # bf16 on CPU too (DeepSpeed's CPU accelerator supports it): fp32 master weights and optimizer state
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": bool(cuda and dtype == torch.float16)},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def make_engine(model, cfg: LearnerParams, ctx: DistContext, grad_accum: int, resume_from: Path | None = None):
    """deepspeed.initialize with a torch AdamW (DeepSpeed's bf16 mode for a bf16 model, on CPU and CUDA; fp16 only on
    CUDA).
    `resume_from`: the policy whose trainer state will be loaded (the universal-checkpoint switch is part of
    the engine's config)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if ctx.device.type == "cuda" else "cpu")
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    # the trainable parameters only: all of them in full fine-tuning, B and A under learner.lora (the base is frozen
    # and neither the optimizer nor ZeRO's partitions hold anything of it)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=cfg.adam_fused)
    dtype = next(model.parameters()).dtype
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer,
        config=ds_config(cfg, ctx.world, grad_accum, dtype, ctx.device.type == "cuda",
                         load_universal=resume_from is not None and resume_mode(resume_from, cfg, ctx) == UNIVERSAL,
                         hidden_size=getattr(getattr(model, "config", None), "hidden_size", None)),
    )
    skip_single_process_allreduce(engine, ctx.world)
    return engine


def skip_single_process_allreduce(engine, world: int) -> bool:
    """On one process with ZeRO stage 0, turn off the engine's gradient all-reduce; returns whether it did.

    At every accumulation boundary DeepSpeed's stage-0 path (`engine.allreduce_gradients` ->
    `buffered_allreduce_fallback`) flattens every gradient into one buffer of up to 5e8 elements, all-reduces it
    over the data-parallel group, multiplies it by 1 / world and copies it back. On one process that is the
    identity, exactly, yet the flat copy is as large as all the gradients (513 MB on SmolLM2-135M). Measured with
    `smdctl bench learner --group-size 8 --memory` it does not lower the learn call's peak (3,455 MB against 3,457),
    which falls elsewhere in the step (docs/design.md §3c); it saves the copy's time and transient memory. `enable_backward_allreduce`
    is DeepSpeed's own switch for it (its pipeline engine and a missing process group turn it off). ZeRO stages 1
    and 2 reduce through their optimizer's own buckets and are left as they are."""
    if world != 1 or engine.zero_optimization_stage() != 0:
        return False
    engine.enable_backward_allreduce = False
    return True


def release_engine(engine) -> None:
    """Free a finished learner's engine now (DeepSpeed's `destroy`, then a garbage collection). One process that
    learns several iterations (`smdctl chain`, `smdctl compare`) otherwise keeps every iteration's engine alive,
    optimizer state and all: measured +400 MB per iteration on a 23M-parameter model and +2 GB on SmolLM2-135M,
    whose chain the kernel's OOM killer stopped at iteration 3 (docs/results-smollm2.md)."""
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()
    gc.collect()


def set_hyperparameters(engine, cfg: LearnerParams) -> None:
    """Apply the current params' optimizer settings (a resumed state carries the previous run's)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = cfg.lr
        group["weight_decay"] = cfg.weight_decay
        group["betas"] = (cfg.adam_beta1, cfg.adam_beta2)
        group["eps"] = cfg.adam_eps


def rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def has_frozen_parameters(engine) -> bool:
    """Whether the engine's model has parameters without gradient (a LoRA base, `learner.lora`): the trainer state
    excludes them (DeepSpeed's `exclude_frozen_parameters`), so its module state loads non-strictly."""
    return any(not p.requires_grad for p in engine.module.parameters())


def save_trainer_state(engine, directory: Path, meta: dict[str, Any], ctx: DistContext) -> None:
    """Collective: every process writes its part of the DeepSpeed checkpoint under `directory`."""
    # frozen parameters (a LoRA base: learner.lora) are not state: the adapter's checkpoint holds the adapter alone
    engine.save_checkpoint(str(directory), tag=STATE_TAG, client_state={"rng": rng_state(), **meta},
                           exclude_frozen_parameters=True)
    if ctx.is_main:
        (directory / STATE_JSON).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def _saved_meta(policy_path: Path) -> dict[str, Any] | None:
    """trainer_state.json of the policy's trainer state; None when the policy has none (a fresh optimizer). A
    trainer_state/ that is damaged (its record missing, not JSON, or without the integers it must hold) is bad
    input: one line, never a silently fresh optimizer."""
    directory = Path(policy_path) / TRAINER_STATE
    if not directory.exists() and not directory.is_symlink():
        return None
    meta_path = directory / STATE_JSON
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:  # missing, a directory, not text, not JSON
        raise SmdInputError(f"{meta_path}: unreadable trainer state ({exc.__class__.__name__}); remove {directory} "
                            "to start with a fresh optimizer") from exc
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in ("world_size", "zero_stage")):
        raise SmdInputError(f"{meta_path}: world_size, zero_stage: expected integers; remove {directory} to start "
                            "with a fresh optimizer")
    return meta


def saved_zero_stage(policy_path: Path) -> int | None:
    """The ZeRO stage of the trainer state saved beside `policy_path`; None when it has none."""
    meta = _saved_meta(policy_path)
    return None if meta is None else int(meta["zero_stage"])


def resume_mode(policy_path: Path, cfg: LearnerParams, ctx: DistContext) -> str | None:
    """How the trainer state saved beside `policy_path` resumes under this run's process count and ZeRO stage:
    SAME (DeepSpeed's checkpoint as saved), UNIVERSAL (converted to a universal checkpoint) or None (nothing
    saved, or ZeRO stage 0 on one side only: a fresh optimizer)."""
    meta = _saved_meta(policy_path)
    if meta is None:
        return None
    world, stage = meta.get("world_size"), meta.get("zero_stage")
    running = zero_stage_for(cfg.zero_stage, ctx.world, stage)
    if stage == running and (world == ctx.world or stage == 0):
        return SAME  # stage 0: every process holds the whole optimizer state (one file for any count)
    if stage in (1, 2) and running in (1, 2) and isinstance(world, int):
        return UNIVERSAL
    return None


def _to_universal(state_dir: Path, out_dir: Path) -> None:
    """DeepSpeed's converter (ds_to_universal) of the ZeRO checkpoint `state_dir` into `out_dir` (quietly)."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(state_dir), output_folder=str(out_dir), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              # states saved before the learner recorded universal-checkpoint info
                              inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)


def _load_universal(engine, directory: Path, ctx: DistContext) -> tuple[str | None, dict[str, Any] | None]:
    """Collective: rank 0 converts `directory`'s checkpoint into a scratch directory beside the policy (visible
    to every process, like the policy itself); every process loads its new partition; rank 0 removes it."""
    scratch = None
    if ctx.is_main:
        scratch = directory.parent.parent / f".{directory.parent.name}.universal-{uuid.uuid4().hex[:8]}"
    error = None
    if ctx.is_main:
        try:
            _to_universal(directory / STATE_TAG, scratch / UNIVERSAL_TAG)
        except Exception as exc:  # noqa: BLE001 - reported on every process by `agree`
            error = exc
    try:
        scratch = Path(agree(ctx, str(scratch) if scratch else None, error)[0])
        return engine.load_checkpoint(str(scratch), tag=UNIVERSAL_TAG, load_optimizer_states=True,
                                      load_lr_scheduler_states=False, load_module_strict=True)
    finally:
        if ctx.world > 1:
            dist.barrier()
        if ctx.is_main and scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def load_trainer_state(engine, policy_path: Path, cfg: LearnerParams, ctx: DistContext) -> dict[str, Any] | None:
    """Resume optimizer state, step counter and RNG from `<policy>/trainer_state`; None when absent/incompatible.

    Another process count (or ZeRO stage 1 <-> 2) goes through DeepSpeed's universal checkpoint; the engine
    must then have been built with `make_engine(..., resume_from=policy_path)`."""
    directory = Path(policy_path) / TRAINER_STATE
    meta = _saved_meta(policy_path)
    if meta is None:
        return None
    mode = resume_mode(policy_path, cfg, ctx)
    want = {"world_size": ctx.world, "zero_stage": zero_stage_for(cfg.zero_stage, ctx.world, meta.get("zero_stage"))}
    got = {k: meta.get(k) for k in want}
    if mode is None:
        if ctx.is_main:
            print(f"warning: {directory}: saved with {got}, running with {want}; starting a fresh optimizer",
                  file=sys.stderr)
        return None
    try:
        if mode == UNIVERSAL:
            load_path, client = _load_universal(engine, directory, ctx)
        else:
            load_path, client = engine.load_checkpoint(str(directory), tag=STATE_TAG, load_optimizer_states=True,
                                                       load_lr_scheduler_states=False,
                                                       # frozen parameters were not saved (a LoRA base)
                                                       load_module_strict=not has_frozen_parameters(engine))
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError, AttributeError,
            AssertionError, pickle.UnpicklingError) as exc:
        # torch.load of a cut or damaged file, a state of another model; DeepSpeed asserts on missing files
        raise SmdInputError(f"{directory}: unreadable DeepSpeed checkpoint ({exc.__class__.__name__}); remove it to "
                            "start with a fresh optimizer") from exc
    if load_path is None:  # DeepSpeed found no checkpoint under its tag (it logs why)
        raise SmdInputError(f"{directory}: no DeepSpeed checkpoint under tag {STATE_TAG!r}; remove it to start with a "
                            "fresh optimizer")
    set_hyperparameters(engine, cfg)
    if client and "rng" in client:
        set_rng_state(client["rng"])
    return {**meta, "resumed_from": got, "resume_mode": mode}
