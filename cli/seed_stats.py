"""`smdctl seed-stats`: 95% intervals over seeds and paired differences to a reference arm (stages.tools.seed_stats)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.common import echo_written, guarded


def register(app: typer.Typer) -> None:
    @app.command("seed-stats")
    def seed_stats_cmd(
        runs: Annotated[list[Path], typer.Argument(
            help="Run directories <arm>-s<seed> of `smdctl compare` (e.g. <out>/*-s*).")],
        reference: Annotated[str, typer.Option(help="The arm the paired differences are taken to.")] = "dense",
        out: Annotated[Path, typer.Option(help="Output directory of seed_stats.md, seed_stats.json and the PNGs.")]
        = Path("reports/seed_stats"),
        complete_at: Annotated[int | None, typer.Option(
            "--complete-at", min=0,
            help="Use only runs that evaluated this iteration; the others are left out with a note "
                 "(default: the largest iteration any given run evaluated; 0 keeps all).")] = None,
    ) -> None:
        """Per arm and evaluated iteration: mean, std and 95% t interval over seeds; paired differences to the
        reference arm seed by seed; learning curves with 95% bands."""
        from stages.tools.seed_stats import headline_lines, seed_stats

        written, skipped, result = guarded(lambda: seed_stats(runs, reference, out, complete_at))
        for note in skipped:
            print(f"note: left out {note}", file=sys.stderr)
        print("\n".join(headline_lines(result)))
        echo_written(written)
