"""Shared CLI plumbing: params loading with overrides, and the one-line error contract (exit code 2)."""

from __future__ import annotations

import errno
import os
import re
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


def load(params: Path, overrides: list[str] | None, scores: bool = True) -> Params:
    return guarded(lambda: load_params(params, overrides, scores))


# A write that cannot complete for lack of room: a full disk, a quota, a file-size limit (RLIMIT_FSIZE).
DISK_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def disk_full_errno(err: OSError) -> int | None:
    """The errno of a disk-full error, also where a library (Arrow) keeps it only in the message."""
    if err.errno in DISK_FULL:
        return err.errno
    found = re.search(r"\[errno (\d+)\]", str(err), re.IGNORECASE)
    return int(found.group(1)) if found and int(found.group(1)) in DISK_FULL else None


def guarded(fn: Callable[[], T]) -> T:
    """Run a stage entry; bad input becomes one line on stderr and exit code 2. A failed process of a
    multi-process stage (SmdRankError, raised by every process) is printed by rank 0 only. A full disk (or a
    file-size or quota limit) during a write is one line and exit code 1: the write was atomic, so the previous
    artifact is still in place (issue 24)."""
    try:
        return fn()
    except OSError as err:
        code = disk_full_errno(err)
        if code is None:
            raise
        where = f": {err.filename}" if err.filename else ""
        print(f"error: disk full while writing{where} ({errno.errorcode.get(code, code)}: {os.strerror(code)}); "
              "nothing was replaced, the previous artifacts are unchanged", file=sys.stderr)
        raise typer.Exit(code=1) from None
    except SmdInputError as err:
        # `reporter`: the rank that prints, 0 unless rank 0's process is the one lost (stages.common.distributed).
        if not isinstance(err, SmdRankError) or os.environ.get("RANK", "0") == str(getattr(err, "reporter", 0)):
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
