"""`smdctl compare`: a comparison of arms x seeds as one resumable command (stages.tools.compare; parses and calls)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, guarded
from cli.paths import RUN, WARMSTART_POLICY

DEFAULT_SPEC = Path("experiments/paper_comparison.yaml")


def register(app: typer.Typer) -> None:
    @app.command("compare")
    def compare_cmd(
        out: Annotated[Path, typer.Option("--out", help="Directory of the runs, the report and compare.json.")],
        spec: Annotated[Path, typer.Option(help="Comparison spec: arms, seeds, iterations.")] = DEFAULT_SPEC,
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        warmstart: Annotated[Path, typer.Option(help="The policy every run starts from.")] = WARMSTART_POLICY,
        data: Annotated[Path, typer.Option(help="Directory with train.arrow and eval.arrow.")] = RUN.data,
        arms: Annotated[str | None, typer.Option(help="Comma-separated arms to run (default: all).")] = None,
        workers: Annotated[int | None, typer.Option(min=1, help="Runs at a time (default: the spec's).")] = None,
        iterations: Annotated[int | None, typer.Option(min=1, help="Iterations per run (default: the spec's).")] = None,
        seeds: Annotated[str | None, typer.Option(help="Comma-separated seeds (default: the spec's), e.g. 0,1.")] = None,
        eval_every: Annotated[int | None, typer.Option(
            min=0, help="Evaluate every K iterations and the last (default: the spec's); 0: no evaluation.")] = None,
    ) -> None:
        """Run every arm x seed of a comparison spec (resumable), then report them side by side."""
        from stages.tools.compare import run_compare

        written = guarded(lambda: run_compare(spec, out, params, overrides or [], warmstart, data, arms, workers,
                                              iterations, seeds, eval_every))
        print(f"report: {written['report']}\nsummary: {written['summary']}", file=sys.stderr)
