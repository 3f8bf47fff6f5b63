"""`smdctl prepare`: write the train/eval prompt tables of the configured task."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, echo_written, guarded, load


def register(app: typer.Typer) -> None:
    @app.command("prepare")
    def prepare(
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        out: Annotated[
            Path, typer.Option(help="Output directory of train.arrow, eval.arrow, stats.json.")
        ] = Path("artifacts/data"),
    ) -> None:
        """Generate (synthetic) or load (data set files) the task's prompts, tokenized for the policy."""
        from stages.prepare import run_prepare

        p = load(params, overrides, scores=False)  # never scores: no reward.function needed
        echo_written(guarded(lambda: run_prepare(p.prepare, p.model.init_path, out, seed=p.seed)))
