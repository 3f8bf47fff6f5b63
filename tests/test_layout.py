"""Package layout (docs/design.md, Layout): a stage package imports only shared packages and `schemas/`.

Stage packages are the pipeline's stages (`stages/<stage>/`); every other module or package under `stages/`
is shared (model loading, the evicting KV cache, synthetic rollouts, inspection, reporting) and imports no
stage package; `schemas/` imports nothing from `stages/`. Imports are read with `ast`, including imports
inside functions, so a lazy import counts like a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ROOT / "stages"
STAGE_PACKAGES = ("prepare", "warmstart", "rollout", "compaction", "learner", "evaluate")


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


def stage_of(module: str) -> str | None:
    """The stage package a dotted module name belongs to (None for shared modules and non-project modules)."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "stages" and parts[1] in STAGE_PACKAGES:
        return parts[1]
    return None


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_stage_packages_exist():
    for stage in STAGE_PACKAGES:
        assert (STAGES / stage / "__init__.py").exists(), f"stages/{stage}: listed as a stage package but missing"


@pytest.mark.parametrize("stage", STAGE_PACKAGES)
def test_stage_imports_no_other_stage(stage):
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(STAGES / stage)
        for name in sorted(imported_modules(path))
        if stage_of(name) not in (None, stage)
    ]
    assert not bad, "a stage imports another stage's internals; move what both need to a shared package:\n" + "\n".join(bad)


def test_shared_modules_import_no_stage():
    shared = [p for p in _modules(STAGES) if p.relative_to(STAGES).parts[0] not in STAGE_PACKAGES]
    assert any(p.name == "model.py" for p in shared)
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in shared
        for name in sorted(imported_modules(path))
        if stage_of(name) is not None
    ]
    assert not bad, "a shared module imports a stage package:\n" + "\n".join(bad)


def test_schemas_import_no_stages():
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(ROOT / "schemas")
        for name in sorted(imported_modules(path))
        if name == "stages" or name.startswith("stages.")
    ]
    assert not bad, "schemas/ is the contract layer and imports nothing from stages/:\n" + "\n".join(bad)


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
