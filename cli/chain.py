"""`smdctl chain`: run on-policy iterations in one process (stages.tools.chain; parses and calls)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, guarded, load
from cli.paths import RUN, WARMSTART_POLICY


def register(app: typer.Typer) -> None:
    @app.command("chain")
    def chain_cmd(
        run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory: params.yaml + artifacts/iter-NNN.")],
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        iterations: Annotated[int | None, typer.Option(
            help="Iterations (default: pipeline.num_iterations).")] = None,
        warmstart: Annotated[Path, typer.Option(help="Policy iteration 1 samples with.")] = WARMSTART_POLICY,
        data: Annotated[Path, typer.Option(help="Directory with train.arrow and eval.arrow.")] = RUN.data,
        eval_every: Annotated[int, typer.Option(
            min=0, help="Evaluate every K iterations (and the last); 0: no evaluation.")] = 1,
    ) -> None:
        """Run the iteration chain in one process under `run-dir` (resumes after the last evaluated iteration)."""
        from stages.tools.chain import run_chain

        p = load(params, overrides)
        guarded(lambda: run_chain(p, run_dir, iterations or p.pipeline.num_iterations, warmstart, data, eval_every))
