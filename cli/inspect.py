"""`smdctl inspect PATH`: kind, schema version, rows and key statistics of any artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import guarded


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    def inspect_cmd(
        path: Annotated[Path, typer.Argument(help="A prompts/trajectories .arrow table or a raw/compacted mask store.")],
    ) -> None:
        """Show an artifact's schema/kind, version, rows and key statistics (per layer/head retention for masks)."""
        from rich.console import Console

        from stages.tools.inspect import inspect_artifact, render

        render(guarded(lambda: inspect_artifact(path)), Console())
