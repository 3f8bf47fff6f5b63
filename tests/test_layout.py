"""Package layout (docs/design.md, Layout): rooms and layers.

Rooms: `schemas/` (the contracts), `stages/common/` (what several stages use), one package per DVC stage
(`stages/<stage>/`), `stages/bench/` (benchmarks and their synthetic data), `stages/tools/` (inspect, report,
chain, compare) and `cli/`. Layers run schemas <- common <- stages <- bench/tools <- cli: a module imports only
its own room and the rooms below it, and a stage never imports another stage. Every package under `stages/` is
one of these rooms. Imports are read with `ast`, including imports inside functions, so a lazy import counts
like a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ROOT / "stages"
STAGE_PACKAGES = ("prepare", "warmstart", "rollout", "compaction", "learner", "evaluate", "progress")
# room -> its layer; a module may import rooms of a lower layer, and its own room
LAYER = {"schemas": 0, "common": 1, **{s: 2 for s in STAGE_PACKAGES}, "bench": 3, "tools": 3, "cli": 4}


def imported_modules(path: Path) -> set[str]:
    """Absolute dotted names a module imports (`from a.b import c` gives a.b and a.b.c)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path.relative_to(ROOT)}: relative import; use absolute `stages.` imports")
    return names


def room_of(module: str) -> str | None:
    """The room a dotted module name belongs to (None for non-project modules and the bare `stages` package)."""
    parts = module.split(".")
    if parts[0] in ("schemas", "cli"):
        return parts[0]
    if parts[0] == "stages" and len(parts) >= 2:
        return parts[1]
    return None


def stage_of(module: str) -> str | None:
    """The stage package a dotted module name belongs to (None for every other room)."""
    room = room_of(module)
    return room if room in STAGE_PACKAGES else None


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_stage_packages_exist():
    for stage in STAGE_PACKAGES:
        assert (STAGES / stage / "__init__.py").exists(), f"stages/{stage}: listed as a stage package but missing"


def test_every_module_under_stages_is_in_a_room():
    loose = [p.relative_to(ROOT).as_posix() for p in _modules(STAGES)
             if p.parent != STAGES and room_of(_dotted(p)) not in LAYER]
    loose += [p.relative_to(ROOT).as_posix() for p in STAGES.glob("*.py") if p.name != "__init__.py"]
    assert not loose, "modules outside the rooms (stages/common, a stage package, stages/bench, stages/tools):\n" + "\n".join(loose)


@pytest.mark.parametrize("room", sorted(LAYER))
def test_layers_import_downward_only(room):
    base = ROOT / room if room in ("schemas", "cli") else STAGES / room
    bad = []
    for path in _modules(base):
        for name in sorted(imported_modules(path)):
            other = room_of(name)
            if other is None or other == room:
                continue
            if other not in LAYER or LAYER[other] >= LAYER[room]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, (f"{room} (layer {LAYER[room]}) imports its own or a lower layer only "
                     "(schemas <- common <- stages <- bench/tools <- cli):\n" + "\n".join(bad))


@pytest.mark.parametrize("stage", STAGE_PACKAGES)
def test_stage_imports_no_other_stage(stage):
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(STAGES / stage)
        for name in sorted(imported_modules(path))
        if stage_of(name) not in (None, stage)
    ]
    assert not bad, "a stage imports another stage's internals; move what both need to stages/common:\n" + "\n".join(bad)


def test_the_layer_check_fails_on_an_upward_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from stages.bench.rollout import bench_rollout\nfrom stages.common.model import load_policy\n")
    rooms = {room_of(n) for n in imported_modules(src)} - {None}
    assert rooms == {"bench", "common"}
    assert [r for r in rooms if LAYER[r] >= LAYER["rollout"]] == ["bench"]


def test_the_checker_sees_lazy_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from stages.rollout.stage import rollout\n    import stages.learner.train\n")
    names = imported_modules(src)
    assert {stage_of(n) for n in names} >= {"rollout", "learner"}


def test_nothing_points_outside_the_repository():
    """The design and every other reference live in the repository (docs/design.md), not in a sibling checkout."""
    import subprocess

    OUTSIDE = "../" "shared"  # noqa: ISC001 (split so that this line does not match itself)
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = [
        f"{name}:{i}"
        for name in files
        if name.endswith((".py", ".md", ".yaml", ".toml", ".cfg", ".txt"))
        for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if OUTSIDE in line
    ]
    assert not bad, "references outside the repository:\n" + "\n".join(bad)


def test_no_test_module_imports_another():
    """Test modules share code through tests/helpers.py (and fixtures through tests/conftest.py), never by
    importing each other: a helper moved or renamed in one test module would break another."""
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(ROOT / "tests")
        for name in sorted(imported_modules(path))
        if name.startswith("tests.test_")
    ]
    assert not bad, "move what several test modules use into tests/helpers.py:\n" + "\n".join(bad)
