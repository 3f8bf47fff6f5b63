"""`smdctl init-model`: build the tiny default policy from params (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, echo_written, guarded, load


def register(app: typer.Typer) -> None:
    @app.command("init-model")
    def init_model(
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        out: Annotated[Path | None, typer.Option(help="Output directory (default: model.init_path).")] = None,
    ) -> None:
        """Build the tiny Qwen3-architecture default model and its word-level tokenizer."""
        from stages.model import init_tiny_model

        p = load(params, overrides)
        echo_written(guarded(lambda: init_tiny_model(p.model.tiny, out or p.model.init_path, seed=p.seed)))
