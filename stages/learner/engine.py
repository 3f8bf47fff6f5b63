"""DeepSpeed plumbing of the learner: process group, engine, trainer-state checkpoints.

One process by default: the process group (gloo on CPU, nccl on CUDA) is created by
`stages.distributed.init_distributed` with world size 1 on 127.0.0.1 and a free port. Under the `deepspeed` launcher (or `torchrun`) RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT come from the environment and every process runs the same
command; the learner shards the batch by rank.

The optimizer is a plain `torch.optim.AdamW` handed to `deepspeed.initialize` (no DeepSpeed Adam op to
compile); ZeRO stage, gradient clipping and accumulation come from `learner:` params. Gradients are
averaged over processes by DeepSpeed; the learner scales each micro-batch loss so that the sum over all
micro-batches and processes is exactly the objective of the whole mini-batch (see `stages.learner.train`).

Trainer state (`<policy>/trainer_state/`): a DeepSpeed checkpoint (optimizer moments, ZeRO partitions,
step counters) with tag `state`, plus `trainer_state.json` (world size, ZeRO stage, global step, RNG
states live in the checkpoint's client state). The next iteration resumes from it when the number of
processes and the ZeRO stage match; otherwise it starts a fresh optimizer and says so.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from schemas.params.learner import LearnerParams
from stages.distributed import DistContext, init_distributed  # noqa: F401 - the learner's process group

TRAINER_STATE = "trainer_state"
STATE_TAG = "state"
STATE_JSON = "trainer_state.json"


def ds_config(cfg: LearnerParams, world: int, grad_accum: int, dtype: torch.dtype, cuda: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": cfg.micro_batch_size * grad_accum * world,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bool(cuda and dtype == torch.bfloat16)},
        "fp16": {"enabled": bool(cuda and dtype == torch.float16)},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def make_engine(model, cfg: LearnerParams, ctx: DistContext, grad_accum: int):
    """deepspeed.initialize with a torch AdamW (fp32 on CPU; bf16/fp16 only on CUDA with such a model)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if ctx.device.type == "cuda" else "cpu")
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    dtype = next(model.parameters()).dtype
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer,
        config=ds_config(cfg, ctx.world, grad_accum, dtype, ctx.device.type == "cuda"),
    )
    return engine


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


def save_trainer_state(engine, directory: Path, meta: dict[str, Any], ctx: DistContext) -> None:
    """Collective: every process writes its part of the DeepSpeed checkpoint under `directory`."""
    engine.save_checkpoint(str(directory), tag=STATE_TAG, client_state={"rng": rng_state(), **meta})
    if ctx.is_main:
        (directory / STATE_JSON).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def load_trainer_state(engine, policy_path: Path, cfg: LearnerParams, ctx: DistContext) -> dict[str, Any] | None:
    """Resume optimizer state, step counter and RNG from `<policy>/trainer_state`; None when absent/incompatible."""
    directory = Path(policy_path) / TRAINER_STATE
    meta_path = directory / STATE_JSON
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        meta = {}
    want = {"world_size": ctx.world, "zero_stage": cfg.zero_stage}
    got = {k: meta.get(k) for k in want}
    if got != want:
        if ctx.is_main:
            print(f"warning: {directory}: saved with {got}, running with {want}; starting a fresh optimizer",
                  file=sys.stderr)
        return None
    load_path, client = engine.load_checkpoint(str(directory), tag=STATE_TAG, load_optimizer_states=True,
                                               load_lr_scheduler_states=False, load_module_strict=True)
    if load_path is None:
        if ctx.is_main:
            print(f"warning: {directory}: unreadable DeepSpeed checkpoint; starting a fresh optimizer", file=sys.stderr)
        return None
    set_hyperparameters(engine, cfg)
    if client and "rng" in client:
        set_rng_state(client["rng"])
    return meta
