"""Policy checkpoints carry a digest of their weights (issue 24); loading checks it.

Every policy directory smd writes (init-model, warmstart, learn) holds `weights_digest.json`: the SHA-256 of
each weight file (`*.safetensors`, `*.bin` at the top level) by name. `verify_weights_digest` recomputes them
before the weights are loaded: a flipped byte in a weight (a value safetensors would happily read as another
float) is one line naming the file instead of a silently different policy.

A directory smd did not write (a user's Hugging Face model given as `model.init_path`, which carries no
ownership marker) has no digest and loads as it is; a directory smd wrote must have one (a removed digest file
is refused like a removed weight file).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from schemas.atomic import OWNER_MARKER
from schemas.errors import SmdInputError

DIGEST_FILE = "weights_digest.json"
DIGEST_KIND = "weights_digest"
DIGEST_SCHEMA_VERSION = "1"
WEIGHT_SUFFIXES = (".safetensors", ".bin")
_BLOCK = 1 << 22  # 4 MiB reads: hashing a multi-GB checkpoint never holds it in memory


def file_sha256(path: str | Path) -> str:
    """`sha256:<hex>` of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return "sha256:" + h.hexdigest()


def weight_files(directory: str | Path) -> list[Path]:
    """The weight files of a Hugging Face directory (top level, sorted by name)."""
    return sorted(p for p in Path(directory).iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def write_weights_digest(directory: str | Path) -> Path:
    """Record the digest of every weight file in `directory` (call it after `save_pretrained`, inside the
    atomic write of the directory). Same weights -> the same bytes."""
    directory = Path(directory)
    files = {p.name: file_sha256(p) for p in weight_files(directory)}
    body = {"kind": DIGEST_KIND, "schema_version": DIGEST_SCHEMA_VERSION, "files": files}
    path = directory / DIGEST_FILE
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return path


def verify_weights_digest(path: str | Path) -> None:
    """Check the weight files of a policy directory against its `weights_digest.json`; one line naming the file
    on a missing, unreadable or mismatched digest. A directory without the digest that smd did not write (no
    ownership marker) is accepted as it is."""
    path = Path(path)
    record = path / DIGEST_FILE
    if not record.exists():
        if (path / OWNER_MARKER).exists():
            raise SmdInputError(f"{record}: missing: smd wrote {path} with a digest of its weights")
        return
    try:
        body = json.loads(record.read_text())
        files = body["files"]
        if body.get("kind") != DIGEST_KIND or not isinstance(files, dict):
            raise ValueError("not a weights digest")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise SmdInputError(f"{record}: unreadable weights digest ({exc.__class__.__name__})") from exc
    present = {p.name for p in weight_files(path)}
    if present != set(files):
        raise SmdInputError(f"{record}: files: records {sorted(files)} but {path} holds {sorted(present)}")
    for name, digest in sorted(files.items()):
        if file_sha256(path / name) != digest:
            raise SmdInputError(f"{path / name}: weights do not match {DIGEST_FILE} (the file is damaged: a "
                                "changed byte)")
