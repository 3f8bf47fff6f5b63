"""`smdctl progress` (per-iteration series for DVC plots) and `smdctl summary` (a run's summary, titled by its task and model)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cli.common import echo_written, guarded

COLUMNS = [
    ("reward/mean", "rollout reward"),
    ("eval/dense/score", "eval dense"),
    ("eval/compressed/score", "eval compressed"),
    ("eval/dense/exact_match", "EM dense"),
    ("eval/compressed/exact_match", "EM compressed"),
    ("eval/dense/reference_nll", "ref NLL dense"),
    ("policy/entropy", "entropy"),
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
        from stages.progress.stage import run_progress

        echo_written(guarded(lambda: run_progress(iteration, artifacts)))

    @app.command("summary")
    def summary_cmd(artifacts: Annotated[Path, typer.Option(help="Artifacts root.")] = Path("artifacts")) -> None:
        """Print reward per iteration, dense vs compressed evaluation and mismatch metrics."""
        from stages.progress.stage import run_title, summary_table

        rows = guarded(lambda: summary_table(artifacts))
        table = Table(title=guarded(lambda: run_title(artifacts)))
        table.add_column("iteration")
        for _, title in COLUMNS:
            table.add_column(title, justify="right")
        for row in rows:
            label = {"warmstart": "warm start *", "evaluate": "start"}.get(row.get("start"), str(row["iteration"]))
            table.add_row(label, *(f"{row[k]:.4g}" if k in row else "—" for k, _ in COLUMNS))
        if any(row.get("start") == "warmstart" for row in rows):
            table.caption = ("* the warm start stage's own greedy evaluation (warmstart.eval_max_new_tokens, all eval "
                             "prompts, dense only); the iterations use evaluate's settings")
        Console(width=None if sys.stdout.isatty() else 160).print(table)
        from stages.progress.stage import parity_note

        note = guarded(lambda: parity_note(artifacts))
        if note:
            print(note)
