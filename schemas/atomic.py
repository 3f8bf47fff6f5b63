"""Atomic writes: build an artifact at a temporary sibling path, then rename it into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success replace `final` with it, on error delete it.

    Works for files and directories (Zarr stores, model folders): readers never see a partial artifact.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    if final.exists() or final.is_symlink():
        os.replace(final, old)
    os.replace(tmp, final)
    _remove(old)
