"""`smdctl learn`: GRPO post-training on one iteration's rollouts under DeepSpeed (stages.learner)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, echo_written, guarded, load
from cli.paths import iteration_layout, policy_for_iteration


def register(app: typer.Typer) -> None:
    @app.command("learn")
    def learn_cmd(
        iteration: Annotated[int, typer.Option("--iteration", "-i", min=1, help="On-policy iteration (1-based).")] = 1,
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        policy: Annotated[Path | None, typer.Option(
            help="Policy to train (default: the previous iteration's; warm-start policy for iteration 1).")] = None,
        trajectories: Annotated[Path | None, typer.Option(
            help="Trajectory table (default: artifacts/iter-NNN/rollout/trajectories.arrow).")] = None,
        masks: Annotated[Path | None, typer.Option(
            help="Compacted mask store (default: artifacts/iter-NNN/compact/masks.zarr).")] = None,
        out: Annotated[Path | None, typer.Option(
            help="New policy directory (default: artifacts/iter-NNN/policy).")] = None,
        metrics_dir: Annotated[Path | None, typer.Option(
            help="Metrics directory (default: artifacts/iter-NNN/learn).")] = None,
        quiet: Annotated[bool, typer.Option(help="No per-step lines on stderr.")] = False,
    ) -> None:
        """Shadow-masked GRPO (or a baseline objective) on the iteration's rollouts; writes the next policy.

        One process by default; several through the DeepSpeed launcher (RANK/WORLD_SIZE from its env), e.g.
        `deepspeed --no_local_rank --num_gpus 2 $(which smdctl) learn -i 1` (on CPU add DS_ACCELERATOR=cpu:
        gloo backend).
        """
        from stages.learner.train import run_learner, stderr_log

        p = load(params, overrides)
        layout = iteration_layout(iteration)
        written = guarded(lambda: run_learner(
            p, iteration, policy or policy_for_iteration(iteration),
            trajectories or layout.trajectories,
            masks or layout.masks,
            out or layout.policy,
            metrics_dir or layout.learn,
            log=None if quiet else stderr_log,
        ))
        if os.environ.get("RANK", "0") == "0":
            echo_written(written)
