"""pytest plugin of the GPU check's correctness part (scripts/gpu_check.py, issue 32): one row per test, appended to
the JSON-lines file $SMD_GPU_CHECK_ROWS the moment the test finishes (so a pytest killed at the part's limit still
reports every test it finished), and a `started` record as each test begins (the TIMEOUT row names it).

Loaded with `pytest -p gpu_check_plugin` (scripts/ on PYTHONPATH); without the variable it writes nothing.
Results: PASS (with its seconds), FAIL (the assertion's or exception's first line), ERROR (a failing fixture
set-up or teardown, or a collection error), SKIP (the skip reason).
"""

from __future__ import annotations

import json
import os

ROWS_ENV = "SMD_GPU_CHECK_ROWS"


def _write(record: dict) -> None:
    path = os.environ.get(ROWS_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def _name(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def _cause(report) -> str:
    """The first line of what went wrong (the crash message of a failure, the reason of a skip)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        text = str(longrepr[2])
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr or "")
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    return first.removeprefix("Skipped: ")[:140]


def pytest_runtest_logstart(nodeid, location) -> None:
    _write({"started": _name(nodeid), "part": "correctness"})


def pytest_runtest_logreport(report) -> None:
    row = None
    if report.when == "call":
        if report.passed:
            row = ("PASS", f"{report.duration:.1f}s")
        elif report.failed:
            row = ("FAIL", _cause(report))
        elif report.skipped:
            row = ("SKIP", _cause(report))
    elif report.when == "setup":
        if report.failed:
            row = ("ERROR", "set-up: " + _cause(report))
        elif report.skipped:
            row = ("SKIP", _cause(report))
    elif report.when == "teardown" and report.failed:
        row = ("ERROR", "teardown: " + _cause(report))
    if row is not None:
        _write({"part": "correctness", "item": _name(report.nodeid), "result": row[0], "detail": row[1]})


def pytest_collectreport(report) -> None:
    if report.failed:
        _write({"part": "correctness", "item": f"collect {report.nodeid or 'tests'}", "result": "ERROR",
                "detail": _cause(report)})
