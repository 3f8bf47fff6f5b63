"""`smdctl compact`: raw rollout masks -> learner-ready compacted mask store (stages.compaction)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, echo_written, guarded, load
from cli.paths import iteration_layout
from schemas.layout import METRICS


def register(app: typer.Typer) -> None:
    @app.command("compact")
    def compact_cmd(
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        iteration: Annotated[int, typer.Option("--iteration", "-i", min=1, help="Iteration whose rollout to compact.")] = 1,
        trajectories: Annotated[
            Path | None, typer.Option(help="Trajectory table (default: artifacts/iter-NNN/rollout/trajectories.arrow).")
        ] = None,
        raw_masks: Annotated[
            Path | None, typer.Option(help="Raw mask store (default: artifacts/iter-NNN/rollout/masks.raw.zarr).")
        ] = None,
        out: Annotated[Path | None, typer.Option(help="Compacted store (default: artifacts/iter-NNN/compact/masks.zarr).")] = None,
        metrics: Annotated[
            Path | None, typer.Option(help="Metrics JSON (default: artifacts/iter-NNN/compact/metrics.json).")
        ] = None,
    ) -> None:
        """Merge, validate, deduplicate and compress the rollout's shadow masks for the learner."""
        from stages.compaction import run_compaction

        p = load(params, overrides)
        layout = iteration_layout(iteration)
        echo_written(
            guarded(
                lambda: run_compaction(
                    p.compaction,
                    trajectories or layout.trajectories,
                    raw_masks or layout.raw_masks,
                    out or layout.masks,
                    metrics or layout.compact / METRICS,
                )
            )
        )
