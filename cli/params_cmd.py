"""`smdctl params`: validate params.yaml and print the effective parameters (defaults filled in)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml

from cli.common import ParamsOption, SetOption, guarded, load
from schemas.atomic import atomic_path


def register(app: typer.Typer) -> None:
    @app.command("params")
    def params_cmd(
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        write: Annotated[Path | None, typer.Option(help="Write the effective parameters to this YAML file.")] = None,
    ) -> None:
        """Validate params.yaml (unknown keys and out-of-range values fail, naming the key) and print it in full."""
        p = load(params, overrides)
        text = "# smd parameters: the single source of truth for every stage (see schemas/params/).\n"
        text += yaml.safe_dump(p.model_dump(mode="json"), sort_keys=False)
        if write is None:
            typer.echo(text)
            return
        guarded(lambda: _write(write, text))


def _write(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:  # refuses (one line) a directory smd did not create
        tmp.write_text(text)
