"""Shared CLI plumbing: params loading with overrides, and the one-line error contract (exit code 2)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from schemas.errors import SmdInputError, SmdRankError
from schemas.params import Params, load_params

console = Console(stderr=True)
T = TypeVar("T")

ParamsOption = Annotated[Path, typer.Option("--params", "-p", help="params.yaml to read (single source of truth).")]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-S", help="Override any parameter: section.key=value (repeatable), e.g. -S learner.kl_lambda=0.2."),
]


def load(params: Path, overrides: list[str] | None) -> Params:
    return guarded(lambda: load_params(params, overrides))


def guarded(fn: Callable[[], T]) -> T:
    """Run a stage entry; bad input becomes one line on stderr and exit code 2. A failed process of a
    multi-process stage (SmdRankError, raised by every process) is printed by rank 0 only."""
    try:
        return fn()
    except SmdInputError as err:
        if not isinstance(err, SmdRankError) or os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr)
        raise typer.Exit(code=err.exit_code) from None


def echo_written(written: Any) -> None:
    if os.environ.get("RANK", "0") != "0":
        return  # under the launcher every process writes its part; rank 0 reports the artifacts
    if isinstance(written, dict):
        for key, value in written.items():
            console.print(f"[green]wrote[/green] {key}: {value}")
    elif written is not None:
        console.print(f"[green]wrote[/green] {written}")
