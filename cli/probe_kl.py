"""`smdctl probe-kl`: the dense-teacher KL per needed-fact class and its gradient against the held-out dense NLL's
(stages.tools.kl_probe; parses and calls)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import echo_written, guarded
from cli.paths import ARTIFACTS


def register(app: typer.Typer) -> None:
    @app.command("probe-kl")
    def probe_kl_cmd(
        artifacts: Annotated[Path, typer.Option("--run", help="The run's artifacts directory (iter-NNN/ inside).")]
        = ARTIFACTS,
        iteration: Annotated[int | None, typer.Option(
            min=1, help="Iteration to probe (default: the latest with rollout + compact).")] = None,
        warmstart: Annotated[Path | None, typer.Option(
            help="The policy of iteration 1 (default: <run>/warmstart/policy).")] = None,
        eval_prompts: Annotated[Path | None, typer.Option(
            help="Held-out prompts for g_nll (default: <run>/data/eval.arrow).")] = None,
        rows: Annotated[int, typer.Option(min=1, help="Trajectory rows to probe (a seeded sample).")] = 64,
        eval_rows: Annotated[int, typer.Option(min=1, help="Eval prompts for the held-out NLL gradient.")] = 64,
        temperature: Annotated[float | None, typer.Option(
            help="KL temperature (default: the rollout's, from the trajectory table).")] = None,
        micro_batch_size: Annotated[int, typer.Option(min=1, help="Rows per forward.")] = 8,
        seed: Annotated[int, typer.Option(help="Seed of the row sample and the bootstrap.")] = 0,
        device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
        out: Annotated[Path | None, typer.Option(
            help="JSON to write (default: reports/probe-kl-iter-NNN.json).")] = None,
    ) -> None:
        """Dense-teacher KL per token where the needed fact was evicted / kept, and the cosine of its gradient
        with the gradient of the dense policy's held-out NLL."""
        from rich.console import Console

        from stages.tools.kl_probe import render, run_probe_kl

        record, path = guarded(lambda: run_probe_kl(
            artifacts, iteration, out, warmstart=warmstart, eval_prompts=eval_prompts, rows=rows,
            eval_rows=eval_rows, temperature=temperature, micro_batch_size=micro_batch_size, seed=seed,
            device=device))
        render(record, Console())
        echo_written(path)
