"""`smdctl headline`: write artifacts/metrics.json, the default experiment's headline (dvc.yaml's one DVC metric)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import echo_written, guarded
from schemas.layout import METRICS, RunLayout


def register(app: typer.Typer) -> None:
    @app.command("headline")
    def headline_cmd(
        iteration: Annotated[int, typer.Option("--iteration", "-i", min=1,
                                               help="The chain's last iteration (dvc.yaml: ${last.n}).")],
        artifacts: Annotated[Path, typer.Option(help="Artifacts root.")] = Path("artifacts"),
    ) -> None:
        """Write <artifacts>/metrics.json: iteration N's headline figures (its progress.json row) and the warm
        start's dense score, the one table `dvc metrics show` and `dvc exp show` print."""
        from stages.progress.headline import run_headline

        run = RunLayout(artifacts)
        echo_written(guarded(lambda: run_headline(iteration, run.iteration(iteration).progress,
                                                  run.warmstart / METRICS, run.headline)))
