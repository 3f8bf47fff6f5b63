"""Atomic writes: build an artifact at a temporary sibling path, then rename it into place.

Ownership: every directory written through `atomic_path` carries a marker file (`.smd-owner`, constant
content, so reruns stay byte-identical); a Zarr store carries it as its root metadata instead (Zarr warns
about any stray file in a group): `zarr.json` whose attributes hold smd's `kind` and `schema_version`.
DVC tracks a stage directory's files one by one (rollout/, learn/, evaluate/), so a checkout restores them
without the marker: a directory holding only smd's stage files (`STAGE_FILES`), smd's temporaries and
smd-owned directories counts as smd's too. `atomic_path` replaces an existing directory only when it is smd's
by these rules (or is empty): smd never deletes or overwrites a directory it did not create, such as a
user's model directory given as an output.

Stale temporaries: a writer killed with SIGKILL (or a lost machine) leaves its temporary sibling behind:
`.<name>.tmp-<8 hex>` (or `.<name>.old-<8 hex>` when killed between the two renames). The next write of the
same target removes exactly those names, and only when no live writer can own them: every writer holds a
shared `flock` on the target's parent directory while its temporary exists, and the cleanup runs only when an
exclusive, non-blocking lock on that directory succeeds (the kernel drops a killed process's locks). When the
lock is busy, unsupported (some network file systems) or the name differs in any way, nothing is removed; a
temporary that is a link is unlinked, never followed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from schemas.errors import SmdInputError
from schemas.layout import (
    DETAILS,
    EVAL_PROMPTS,
    METRICS,
    PREDICTIONS,
    PROGRESS,
    STEPS,
    TRAIN_PROMPTS,
    TRAJECTORIES,
)

OWNER_MARKER = ".smd-owner"
OWNER_TEXT = "This directory was written by smd (schemas/atomic.py); smd may replace it.\n"
# The files smd's stages write into their output directories (dvc.yaml tracks them one by one).
STAGE_FILES = frozenset({METRICS, DETAILS, "stats.json", STEPS, PROGRESS, TRAJECTORIES, PREDICTIONS, TRAIN_PROMPTS,
                         EVAL_PROMPTS})
_TEMPORARY = re.compile(r"^\..+\.(tmp|old)-[0-9a-f]{8}$")  # atomic_path's own temporaries


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _zarr_root(path: Path) -> bool:
    return (path / "zarr.json").is_file()


def owned_by_smd(path: str | os.PathLike) -> bool:
    """True when `path` is a directory smd created: it holds the ownership marker, or it is a Zarr store
    whose root attributes carry smd's `kind` and `schema_version`, or it holds only smd's stage files,
    temporaries and smd-owned directories (a stage directory DVC restored file by file)."""
    path = Path(path)
    if (path / OWNER_MARKER).is_file():
        return True
    if not _zarr_root(path):
        return _only_smd_entries(path)
    try:
        attrs = json.loads((path / "zarr.json").read_text()).get("attributes") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(attrs, dict) and "kind" in attrs and "schema_version" in attrs


def _only_smd_entries(path: Path) -> bool:
    """A non-empty directory whose entries are all smd's stage files, temporaries or smd-owned directories."""
    try:
        entries = list(path.iterdir())
    except OSError:
        return False
    for entry in entries:
        if entry.is_symlink():
            return False
        if _TEMPORARY.match(entry.name):
            continue
        if entry.is_dir() and owned_by_smd(entry):
            continue
        if not (entry.is_file() and entry.name in STAGE_FILES):
            return False
    return bool(entries)


def is_foreign_dir(path: str | os.PathLike) -> bool:
    """True when `path` is a directory smd must not replace: a non-empty directory that is not smd's, or a
    link to a directory (smd never creates links, so a link is the user's)."""
    path = Path(path)
    if path.is_symlink():
        return path.is_dir()
    if not path.is_dir() or owned_by_smd(path):
        return False
    return any(path.iterdir())


def check_replaceable(path: str | os.PathLike) -> None:
    """One line (SmdInputError) when `path` is a directory smd did not create and may therefore not replace."""
    if is_foreign_dir(path):
        raise SmdInputError(
            f"{path}: an existing directory smd did not create (no {OWNER_MARKER} marker); refusing to replace "
            "it. Move it away or choose another output path"
        )


def stale_temporaries(final: str | os.PathLike) -> list[Path]:
    """The temporaries `atomic_path` names for `final` that exist beside it (`.<name>.tmp-<8 hex>`,
    `.<name>.old-<8 hex>`): only these names, never another entry of the directory."""
    final = Path(final)
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.(tmp|old)-[0-9a-f]{{8}}$")
    try:
        return sorted(entry for entry in final.parent.iterdir() if pattern.match(entry.name))
    except OSError:
        return []


@contextlib.contextmanager
def _writer_lock(final: Path) -> Iterator[None]:
    """Hold a shared lock on `final`'s parent while writing; first remove `final`'s stale temporaries when an
    exclusive lock shows that no other writer is active there (their shared locks would block it)."""
    try:
        fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        exclusive, lockable = True, True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:  # another writer is active (EWOULDBLOCK), or no flock here: remove nothing
            exclusive, lockable = False, exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
        if exclusive:
            for stale in stale_temporaries(final):
                _remove(stale)
        if lockable:
            fcntl.flock(fd, fcntl.LOCK_SH)  # from exclusive: a downgrade; else wait out a cleanup in progress
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success replace `final` with it, on error delete it.

    Works for files and directories (Zarr stores, model folders): readers never see a partial artifact.
    A directory built at the temporary path gets the ownership marker (a Zarr store: its root attributes
    instead, which its writer sets). An existing `final` that is a
    directory smd did not create is refused (SmdInputError), before and after the body runs. Temporaries of
    `final` left by a killed writer are removed first (see the module docstring).
    """
    final = Path(final)
    check_replaceable(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _writer_lock(final):
        tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            yield tmp
            if tmp.is_dir() and not tmp.is_symlink() and not _zarr_root(tmp):
                (tmp / OWNER_MARKER).write_text(OWNER_TEXT)
            check_replaceable(final)  # something may have appeared at `final` while the body ran
        except BaseException:
            _remove(tmp)
            raise
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        if final.exists() or final.is_symlink():
            os.replace(final, old)
        os.replace(tmp, final)
        _remove(old)
