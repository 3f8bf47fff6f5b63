"""dvc.yaml declares what each stage's command really runs and reads.

For every stage, the command's module (`smdctl NAME` -> the `cli/` module that registers NAME) and the
project modules it imports, transitively (ast; imports inside functions count), must be covered by the
stage's `deps` (the file, or a directory above it); a code dependency that covers none of them is stale.
The `cli/` modules of the command count: they choose the default paths and what reaches the stage.
Not counted: `cli/main.py` (the dispatcher; it imports every command, and a command is started from its own
module) and empty `__init__.py` files (a docstring at most; they run no code).

Params: starting from the command function's `p = load(...)`, each value taken from the params tree is
followed through assignments and calls into project functions (arguments bound to the callee's parameters);
wherever it is read (an attribute that is not passed on, a whole section dumped or handed to code this check
cannot follow) that key is read. Every read key must be declared in `params` (the key or a section above
it), and every declared key must be read (or lie under a read section).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from schemas.params import Params

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "schemas", "stages")
NOT_COUNTED = {"cli/main.py"}


# ------------------------------------------------------------------ modules


def module_path(name: str) -> Path | None:
    """The file of a project module (`a.b` -> a/b.py or a/b/__init__.py), None if not one."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


@functools.cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imports_of(path: Path) -> set[str]:
    """Project modules a file imports anywhere in it, with the packages each import runs."""
    names: set[str] = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    found = set()
    for name in names:
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if module_path(".".join(parts[:i])))
    return found


def is_empty_init(path: Path) -> bool:
    body = parse(path).body
    return path.name == "__init__.py" and all(
        isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body
    )


def closure(start: str) -> set[str]:
    """Files (relative to the repo) of `start` and every project module it imports, transitively."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(imports_of(module_path(name)) - seen)
    files = {module_path(n).relative_to(ROOT).as_posix() for n in seen}
    return {f for f in files if f not in NOT_COUNTED and not is_empty_init(ROOT / f)}


# ------------------------------------------------------------------ dvc.yaml


def dvc_stages() -> dict[str, dict[str, Any]]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: stage.get("do", stage) for name, stage in stages.items()}


def command_function(cmd: str) -> tuple[str, ast.FunctionDef]:
    """The cli module and function that `smdctl NAME ...` runs."""
    m = re.match(r"smdctl\s+([\w-]+)", cmd)
    assert m, f"cmd {cmd!r} does not run smdctl"
    for path in sorted((ROOT / "cli").glob("*.py")):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "command"
                            and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app" and dec.args and isinstance(dec.args[0], ast.Constant) and dec.args[0].value == m.group(1)):
                        return f"cli.{path.stem}", node
    raise AssertionError(f"no cli module registers the command {m.group(1)!r}")


def command_functions(cmd: str) -> list[tuple[str, ast.FunctionDef]]:
    """What a stage's cmd runs: `smdctl NAME ...`, or `smdctl launch NAME ...` (cli/launch.py reads the process
    count, then NAME runs under the launcher): both commands' modules and functions."""
    m = re.match(r"smdctl\s+([\w-]+)(?:\s+([\w-]+))?", cmd)
    assert m, f"cmd {cmd!r} does not run smdctl"
    names = [m.group(1)] + ([m.group(2)] if m.group(1) == "launch" and m.group(2) else [])
    return [command_function(f"smdctl {name}") for name in names]


def covered(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


def code_deps(stage: dict[str, Any]) -> list[str]:
    return [d for d in stage.get("deps", []) if d.split("/")[0] in PACKAGES]


# ------------------------------------------------------------------ params read


def _section_tree(model: type[BaseModel], prefix: str = "") -> dict[str, bool]:
    """Dotted key -> is a section (a nested model), for every key of the params tree."""
    out = {}
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = field.annotation
        is_section = isinstance(sub, type) and issubclass(sub, BaseModel)
        out[key] = is_section
        if is_section:
            out.update(_section_tree(sub, key + "."))
    return out


KEYS = _section_tree(Params)


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """`a.b.c` -> ("a", ["b", "c"]); None if the expression is not a name with attributes."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def _key(env: dict[str, str], node: ast.AST) -> str | None:
    """The params key an expression denotes: a bound name plus the attributes that are params fields."""
    c = _chain(node)
    if c is None or c[0] not in env:
        return None
    key = env[c[0]]
    for attr in c[1]:
        nxt = f"{key}.{attr}" if key else attr
        if nxt not in KEYS:
            break
        key = nxt
    return key


class _Module:
    def __init__(self, name: str):
        self.name = name
        self.tree = parse(module_path(name))

    def symbol(self, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Resolve a name in this module to (module, FunctionDef/ClassDef) or (module name, None) for a module."""
        if depth > 5:
            return None
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
                return self.name, node
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        if module_path(f"{node.module}.{alias.name}"):
                            return f"{node.module}.{alias.name}", None
                        if module_path(node.module):
                            return _Module(node.module).symbol(alias.name, depth + 1)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name and module_path(alias.name):
                        return alias.name, None
        return None

    def callee(self, func: ast.AST) -> tuple[str, ast.FunctionDef] | None:
        """The project function (or class __init__) a call goes to, if this check can tell."""
        target = None
        if isinstance(func, ast.Name):
            target = self.symbol(func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = self.symbol(func.value.id)
            if base and base[1] is None:
                target = _Module(base[0]).symbol(func.attr)
        if not target or target[1] is None:
            return None
        module, node = target
        if isinstance(node, ast.ClassDef):
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            return (module, init) if init else None
        return module, node


def _bind(call: ast.Call, func: ast.FunctionDef, env: dict[str, str], reads: set[str]) -> dict[str, str]:
    """Callee parameter -> params key for the arguments that carry a params value (others are read here)."""
    params = [a.arg for a in func.args.posonlyargs + func.args.args]
    if params and params[0] == "self":
        params = params[1:]
    names = params + [a.arg for a in func.args.kwonlyargs]
    bound = {}
    for i, arg in enumerate(call.args):
        key = _key(env, arg)
        if key is None:
            continue
        if i < len(params) and not isinstance(arg, ast.Starred):
            bound[params[i]] = key
        else:
            reads.add(key)
    for kw in call.keywords:
        key = _key(env, kw.value)
        if key is None:
            continue
        if kw.arg in names:
            bound[kw.arg] = key
        else:
            reads.add(key)
    return bound


def _reads(module: str, func: ast.FunctionDef, env: dict[str, str], seen: set) -> set[str]:
    """Params keys a function reads, given which of its names hold which params values."""
    memo = (module, func.lineno, tuple(sorted(env.items())))
    if memo in seen:
        return set()
    seen.add(memo)
    mod = _Module(module)
    env = dict(env)
    for node in ast.walk(func):  # aliases: x = <params value>; p = load(...) is the whole tree
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                    and value.func.id in ("load", "load_params")):
                env[node.targets[0].id] = ""
            elif _key(env, value) is not None:
                env[node.targets[0].id] = _key(env, value)
    reads: set[str] = set()
    passed: set[int] = set()  # expressions handed on: to a followed call, or to an alias
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            target = mod.callee(node.func)
            if target is not None:
                bound = _bind(node, target[1], env, reads)
                passed.update(id(a) for a in [*node.args, *(k.value for k in node.keywords)] if _key(env, a) is not None)
                reads |= _reads(target[0], target[1], bound, seen)
        elif isinstance(node, ast.Assign) and _key(env, node.value) is not None and isinstance(node.targets[0], ast.Name):
            passed.add(id(node.value))
    parents = {id(child): parent for parent in ast.walk(func) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(func):
        if id(node) in passed or not isinstance(node, ast.Name | ast.Attribute):
            continue
        if isinstance(parents.get(id(node)), ast.Attribute):
            continue  # not the whole chain
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            continue
        key = _key(env, node)
        if key is not None:
            reads.add(key)
    return {k for k in reads if k}  # "" = the whole tree handed on and followed


def params_read(cmd: str) -> set[str]:
    return {key for module, func in command_functions(cmd) for key in _reads(module, func, {}, set())}


def declared_params(stage: dict[str, Any]) -> list[str]:
    out = []
    for p in stage.get("params", []):
        out.extend([p] if isinstance(p, str) else [k for keys in p.values() for k in keys])
    return out


def _under(key: str, section: str) -> bool:
    return key == section or key.startswith(section + ".")


# ------------------------------------------------------------------ tests

STAGES = dvc_stages()


@pytest.mark.parametrize("name", sorted(STAGES))
def test_deps_cover_the_code_the_command_runs(name):
    stage = STAGES[name]
    files = {f for module, _ in command_functions(stage["cmd"]) for f in closure(module)}
    deps = code_deps(stage)
    missing = sorted(f for f in files if not covered(f, deps))
    stale = sorted(d for d in deps if not any(covered(f, [d]) for f in files))
    assert not missing and not stale, (
        f"dvc.yaml stage {name!r} ({stage['cmd'].split()[1]}): deps missing {missing or '-'}; "
        f"deps its command does not import {stale or '-'}"
    )


def covered_files(deps: list[str]) -> set[str]:
    """The code files (.py, empty `__init__.py` files aside) that a stage's code deps name, directories expanded."""
    out = set()
    for d in deps:
        path = ROOT / d
        for f in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            if "__pycache__" not in f.parts and f.suffix == ".py" and not is_empty_init(f):
                out.add(f.relative_to(ROOT).as_posix())
    return out


@pytest.mark.parametrize("name", sorted(STAGES))
def test_deps_name_only_the_code_the_command_runs(name):
    """The other direction, file by file: a dep directory holds no module the command does not run, so that
    editing a bench or a tool (stages/bench, stages/tools) reruns no stage."""
    stage = STAGES[name]
    files = {f for module, _ in command_functions(stage["cmd"]) for f in closure(module)}
    extra = sorted(covered_files(code_deps(stage)) - files)
    assert not extra, f"dvc.yaml stage {name!r}: deps hold modules its command never imports: {extra}"


def test_no_stage_depends_on_a_bench_or_a_tool():
    for name, stage in STAGES.items():
        bad = [f for f in covered_files(code_deps(stage)) if f.startswith(("stages/bench/", "stages/tools/"))]
        assert not bad, f"dvc.yaml stage {name!r} depends on {bad}: a bench or tool edit would rerun it"


@pytest.mark.parametrize("name", sorted(STAGES))
def test_params_cover_the_keys_the_command_reads(name):
    stage = STAGES[name]
    reads = params_read(stage["cmd"])
    declared = declared_params(stage)
    missing = sorted(k for k in reads if not any(_under(k, d) for d in declared))
    unused = sorted(d for d in declared if not any(_under(k, d) or _under(d, k) for k in reads))
    assert not missing and not unused, (
        f"dvc.yaml stage {name!r}: params missing {missing or '-'}; declared but not read {unused or '-'}"
    )


def test_the_checks_see_what_the_issue_found():
    """The gaps a review found before this test existed are what the checks report on that dvc.yaml."""
    assert "model.dtype" in params_read("smdctl learn -i 1")
    assert "model.dtype" in params_read("smdctl evaluate -i 1")
    assert {"model.dtype", "model.init_path"} <= params_read("smdctl warmstart")
    assert "model.init_path" in params_read("smdctl prepare")
    rollout = closure("cli.rollout")
    assert {"schemas/rewards.py", "schemas/raw_masks.py", "stages/common/model.py"} <= rollout
    assert any(f.startswith("stages/common/kvcache/") for f in closure("cli.evaluate"))
    assert "schemas/raw_masks.py" in closure("cli.learn")
    assert {"pipeline.processes", "pipeline.hostfile", "rollout"} <= params_read("smdctl launch rollout -i 1")
