"""`smdctl progress` (per-iteration series for DVC plots) and `smdctl summary` (the default experiment's summary)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cli.common import echo_written, guarded

COLUMNS = [
    ("reward/mean", "reward"),
    ("eval/dense/score", "eval dense"),
    ("eval/compressed/score", "eval compressed"),
    ("kv/kept_fraction", "KV kept"),
    ("mismatch/logprob_abs_diff_max", "|dlogp| max"),
    ("mismatch/kl", "mismatch KL"),
]


def register(app: typer.Typer) -> None:
    @app.command("progress")
    def progress_cmd(
        iteration: Annotated[int, typer.Option("--iteration", "-i", min=1, help="Last iteration to include.")] = 1,
        artifacts: Annotated[Path, typer.Option(help="Artifacts root.")] = Path("artifacts"),
    ) -> None:
        """Write artifacts/iter-NNN/progress.json: headline metrics of iterations 1..N (DVC plots)."""
        from stages.evaluate.progress import progress

        echo_written(guarded(lambda: progress(iteration, artifacts)))

    @app.command("summary")
    def summary_cmd(artifacts: Annotated[Path, typer.Option(help="Artifacts root.")] = Path("artifacts")) -> None:
        """Print reward per iteration, dense vs compressed evaluation and mismatch metrics."""
        from stages.evaluate.progress import summary_table

        rows = guarded(lambda: summary_table(artifacts))
        table = Table(title="smd: default experiment")
        table.add_column("iteration")
        for _, title in COLUMNS:
            table.add_column(title, justify="right")
        for row in rows:
            if row["iteration"] == 0:
                label = "warm start"
                cells = ["—", f"{row.get('eval/exact_match', row.get('exact_match', float('nan'))):.3f}"] + ["—"] * 4
                table.add_row(label, *cells)
                continue
            cells = [f"{row[k]:.4g}" if k in row else "—" for k, _ in COLUMNS]
            table.add_row(str(row["iteration"]), *cells)
        Console().print(table)
