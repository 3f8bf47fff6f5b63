"""`smdctl rollout`: sample a GRPO batch with the evicting cache and record shadow masks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, echo_written, guarded, load
from cli.paths import RUN, iteration_layout, policy_for_iteration


def register(app: typer.Typer) -> None:
    @app.command("rollout")
    def rollout_cmd(
        iteration: Annotated[int, typer.Option("--iteration", "-i", min=1, help="On-policy iteration (1-based).")] = 1,
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        policy: Annotated[Path | None, typer.Option(help="Policy checkpoint (default: previous iteration's).")] = None,
        prompts: Annotated[Path, typer.Option(help="Train prompts table.")] = RUN.train_prompts,
        out: Annotated[Path | None, typer.Option(help="Output directory (default: artifacts/iter-NNN/rollout).")] = None,
        progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    ) -> None:
        """Sample G responses per prompt with a compressed KV cache; write trajectories and raw masks."""
        from stages.rollout.stage import run_rollout

        p = load(params, overrides)
        written = guarded(lambda: run_rollout(
            p, iteration, policy or policy_for_iteration(iteration), prompts,
            out or iteration_layout(iteration).rollout, show_progress=progress,
        ))
        echo_written(written)
