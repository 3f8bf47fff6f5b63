"""Stage metrics files: the headline figures, and the full record beside them.

Every stage writes two JSON files into its output directory:
- `metrics.json` (prepare: `stats.json`): only the stage's headline figures (what the progress rows, the
  summary, the report and TensorBoard read);
- `details.json` beside it: the whole record (the headline figures too), with the detailed statistics
  (per-head retention, checks, samples) and the configuration the stage ran with.
Both are uncached DVC `outs`, not DVC metrics: dvc.yaml's one metric is the run's headline
`artifacts/metrics.json` (stages.progress.headline), so `dvc metrics show` / `dvc exp show` stay one table.
A headline key `a.b` picks `b` inside the record's `a` (nested the same way in the headline file).
Like every other artifact, both carry `schema_version`; details.json also always carries `config`, the
configuration the stage ran with (`write_metrics` refuses a record without one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError

DETAILS = "details.json"
METRICS_SCHEMA_VERSION = 1


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A metrics-style JSON file (a JSON object) read back; one line naming the file when it is not valid JSON,
    unreadable (a directory, not text) or not an object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SmdInputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SmdInputError(f"{path}: unreadable ({exc.__class__.__name__})") from exc
    if not isinstance(data, dict):
        raise SmdInputError(f"{path}: expected a JSON object, found a {type(data).__name__}")
    return data


def details_path(metrics_path: str | Path) -> Path:
    """Where the full record of a metrics file lives: `details.json` in the same directory."""
    return Path(metrics_path).with_name(DETAILS)


def headline(record: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The headline part of a record: the listed keys that it has (`a.b` for nested keys)."""
    out: dict[str, Any] = {}
    for key in keys:
        if key in record:
            out[key] = record[key]
            continue
        *parents, leaf = key.split(".")
        node = record
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            target = out
            for part in parents:
                target = target.setdefault(part, {})
            target[leaf] = node[leaf]
    return out


def write_metrics(path: str | Path, record: dict[str, Any], keys: Sequence[str],
                  config: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write the headline of `record` to `path` and the whole record to details.json beside it (each atomically),
    both with `schema_version`; details.json gets `config` (the record's own `config`, else the one passed).

    Returns {"metrics": path, "details": details path}.
    """
    path = Path(path)
    details = {**record, "schema_version": METRICS_SCHEMA_VERSION}
    if config is not None:
        details["config"] = config
    if not isinstance(details.get("config"), dict):
        raise ValueError(f"{path}: a stage's metrics record must carry the config it ran with")
    written = {"metrics": path, "details": details_path(path)}
    brief = {**headline(record, keys), "schema_version": METRICS_SCHEMA_VERSION}
    for target, data in ((written["details"], details), (path, brief)):
        with atomic_path(target) as tmp:
            tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return written
