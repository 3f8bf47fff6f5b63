"""`smdctl warmstart`: supervised training so RL starts above zero reward."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, echo_written, guarded, load


def register(app: typer.Typer) -> None:
    @app.command("warmstart")
    def warmstart(
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        data: Annotated[Path, typer.Option(help="Directory with train.arrow and eval.arrow.")] = Path(
            "artifacts/data"
        ),
        out: Annotated[Path, typer.Option(help="Output directory (policy/ and metrics.json).")] = Path(
            "artifacts/warmstart"
        ),
    ) -> None:
        """Train the initial policy on the train split (loss on response tokens), then greedy-evaluate it."""
        from stages.warmstart import run_warmstart

        p = load(params, overrides)
        echo_written(guarded(lambda: run_warmstart(p.warmstart, p.model, data, out, seed=p.seed,
                                                         reward=p.reward, prompt_key=p.prepare.prompt_key)))
