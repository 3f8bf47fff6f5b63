"""`smdctl iterations`: generate dvc.yaml's iteration chain (iterations.yaml) from pipeline.num_iterations."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import ParamsOption, SetOption, guarded, load
from schemas.atomic import atomic_path
from schemas.params import ITERATIONS_FILE, check_iterations_file, iterations_yaml


def register(app: typer.Typer) -> None:
    @app.command("iterations")
    def iterations_cmd(
        params: ParamsOption = Path("params.yaml"),
        overrides: SetOption = None,
        out: Annotated[Path, typer.Option(help="The DVC vars file dvc.yaml reads.")] = Path(ITERATIONS_FILE),
        check: Annotated[bool, typer.Option("--check", help="Only check that the file matches (exit 2 if not).")] = False,
    ) -> None:
        """Write iterations.yaml: one item per on-policy iteration, each naming the policy it starts from.

        params.yaml's `pipeline.num_iterations` is the single source; DVC's templating cannot count, so the
        chain is generated here. Run it after changing the count, then `dvc repro` (earlier iterations stay
        cached). dvc.yaml's `iterations` stage runs `--check`, so a stale file fails the run with one line.
        """
        p = load(params, overrides)
        if check:
            guarded(lambda: check_iterations_file(out, p.pipeline.num_iterations))
            return
        guarded(lambda: _write(out, iterations_yaml(p.pipeline.num_iterations)))
        typer.echo(f"wrote {out}: {p.pipeline.num_iterations} iteration(s)")


def _write(out: Path, text: str) -> None:
    with atomic_path(out) as tmp:  # refuses (one line) a directory smd did not create
        tmp.write_text(text)
