"""The EMA teacher of `learner.kl_teacher: ema`: an exponential moving average of the policy's weights.

The mean teacher of self-distillation (Tarvainen & Valpola 2017, "Mean teachers are better role models"; BYOL, Grill
et al. 2020, its target network with tau 0.99-0.996; DINO, Caron et al. 2021, teacher momentum 0.996): a target
that moves with the student, but slowly, so that it cannot follow the student into a collapsed solution in a few
steps. After every optimizer step

    ema <- decay * ema + (1 - decay) * policy

(`ema_update_`, in place, parameter by parameter: BYOL's `xi <- tau xi + (1 - tau) theta`). The average starts as
a copy of the policy (BYOL, DINO) when the starting checkpoint has none, and is saved with every policy checkpoint
(`<policy>/trainer_state/ema_teacher.safetensors`, every trainable parameter by name, bit for bit), so a chain of
learn calls continues it exactly: each iteration's learn call loads it from the policy it starts from.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from schemas.errors import SmdInputError

__all__ = ["EMA_FILE", "ema_update_", "ema_teacher", "save_ema", "ema_path"]

EMA_FILE = "ema_teacher.safetensors"


def ema_path(policy_dir: str | Path, trainer_state: str) -> Path:
    """Where the EMA of a policy checkpoint lives: `<policy>/<trainer_state>/ema_teacher.safetensors`."""
    return Path(policy_dir) / trainer_state / EMA_FILE


@torch.no_grad()
def ema_update_(ema: torch.nn.Module, policy: torch.nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * policy, for every parameter (matched by name), in place."""
    if not 0.0 <= decay < 1.0:
        raise SmdInputError(f"ema_decay must be in [0, 1), got {decay}")
    mine = dict(ema.named_parameters())
    theirs = dict(policy.named_parameters())
    if mine.keys() != theirs.keys():
        raise SmdInputError("ema teacher: its parameters do not match the policy's")
    for name, e in mine.items():
        e.mul_(decay).add_(theirs[name].detach().to(e.dtype), alpha=1.0 - decay)


def ema_teacher(policy: torch.nn.Module, policy_dir: str | Path, trainer_state: str, dtype: str) -> torch.nn.Module:
    """The EMA teacher for a learn call starting from `policy` (loaded from `policy_dir`): a copy of the policy
    with the saved average's weights when `policy_dir` has one, else the policy's own (the average's start); no
    gradients. One line for a saved average whose parameters do not match, and for a model dtype other than
    float32 (an update of (1 - decay) x a learning-rate-sized step falls below bfloat16's resolution: the average
    would not move)."""
    if dtype != "float32":
        raise SmdInputError(f"learner.kl_teacher=ema: model.dtype {dtype}: the average's updates fall below its "
                            "resolution; run the EMA teacher in float32")
    teacher = copy.deepcopy(policy).requires_grad_(False)
    path = ema_path(policy_dir, trainer_state)
    if path.exists():
        saved = load_file(str(path))
        params = dict(teacher.named_parameters())
        if saved.keys() != params.keys() or any(saved[n].shape != p.shape for n, p in params.items()):
            raise SmdInputError(f"{path}: the saved EMA teacher's parameters do not match the policy's")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(saved[name])
    return teacher


def save_ema(teacher: torch.nn.Module, path: str | Path) -> None:
    """Write every parameter of the EMA teacher by name (safetensors: the same bits back)."""
    save_file({n: p.detach().contiguous().cpu() for n, p in teacher.named_parameters()}, str(path))
