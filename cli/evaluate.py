"""`smdctl evaluate`: greedy held-out evaluation with the dense and the compressed KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, echo_written, guarded, load
from cli.paths import RUN, WARMSTART_POLICY, iteration_layout


def register(app: typer.Typer) -> None:
    @app.command("evaluate")
    def evaluate_cmd(
        iteration: Annotated[int, typer.Option("--iteration", "-i", min=0,
                                               help="Iteration evaluated (0 = the warm-start policy).")] = 1,
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        policy: Annotated[Path | None, typer.Option(
            help="Policy checkpoint (default: artifacts/iter-NNN/policy; artifacts/warmstart/policy for 0).")] = None,
        prompts: Annotated[Path, typer.Option(help="Eval prompts table.")] = RUN.eval_prompts,
        out: Annotated[Path | None, typer.Option(help="Output directory (default: artifacts/iter-NNN/evaluate).")] = None,
        progress: Annotated[bool, typer.Option(help="Show a progress bar and the summary table.")] = True,
    ) -> None:
        """Greedy-decode the eval split with the dense and with the rollout's compressed cache; score both."""
        from stages.evaluate.stage import run_evaluate

        p = load(params, overrides)
        default_policy = WARMSTART_POLICY if iteration == 0 else iteration_layout(iteration).policy
        written = guarded(lambda: run_evaluate(
            p, iteration, policy or default_policy, prompts,
            out or iteration_layout(iteration).evaluate, show_progress=progress,
        ))
        echo_written(written)
