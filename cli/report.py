"""`smdctl report`: compare experiments (Markdown table + PNG plot of reward and evaluation per iteration)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import echo_written, guarded


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report_cmd(
        runs: Annotated[list[Path] | None, typer.Argument(
            help="Run directories: artifacts/ trees, or directories holding artifacts/ and params.yaml "
                 "(default: ./artifacts unless --dvc-exp-json is given).")] = None,
        dvc_exp_json: Annotated[Path | None, typer.Option(
            "--dvc-exp-json", help="Output of `dvc exp show --json` saved to a file.")] = None,
        out: Annotated[Path, typer.Option(help="Output directory of report.md and report.png.")] = Path("reports"),
    ) -> None:
        """Tabulate objective, policy, keep ratio, reward, dense/compressed eval score and mismatch per iteration."""
        from stages.tools.report import report

        echo_written(guarded(lambda: report(runs, dvc_exp_json, out)))
