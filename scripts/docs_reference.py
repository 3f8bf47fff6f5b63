"""The docs site's generated pages (issue 56): the reference, never hand-copied, and docs/design.md by section.

    python3 scripts/docs_reference.py params|cli|artifacts   # print one reference page's Markdown
    python3 scripts/docs_reference.py missing                 # parameters and options without a description

MkDocs builds the pages at build time through mkdocs-gen-files (scripts/gen_docs_pages.py calls these functions),
so the site cannot drift from the code:
- `params_markdown`: every parameter of params.yaml from the pydantic models in schemas/params/ (name, type,
  default, range, description);
- `cli_markdown`: every `smdctl` command and option from the Typer app (cli/main.py), as `--help` prints them;
- `artifacts_markdown`: the artifact contracts of schemas/ (layout, table columns, mask stores, metrics files);
- `design_sections`: docs/design.md split at its `## ` headings, each section's text as written.
`missing_descriptions` lists what the reference would show without a description (tests/test_docs.py).
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script or by mkdocs-gen-files: the project's packages import
    sys.path.insert(0, str(ROOT))

# pydantic constraint metadata -> how the reference writes it
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


# ------------------------------------------------------------------ parameters


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it in YAML terms: `int`, `float | null`, `one of a, b`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin in (list, tuple):
        args = typing.get_args(annotation)
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field: FieldInfo) -> str:
    """The range and pattern pydantic enforces (from the field's metadata), e.g. `>= 0, < 1`."""
    parts = []
    for meta in field.metadata:
        for attr, sign in _BOUNDS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
        for attr in ("min_length", "max_length", "pattern"):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{attr.replace('_', ' ')} {value}")
    return ", ".join(parts)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field holds (a section, or an optional section `X | None`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`" if isinstance(value, str) and value == "" else f"`{value}`"


def section_doc(model: type[BaseModel]) -> str:
    """A section's description: its class docstring, else its module's (e.g. "`learner:` section: ...")."""
    own = model.__doc__ if model.__doc__ and model.__doc__ is not BaseModel.__doc__ else None
    doc = own or sys.modules[model.__module__].__doc__ or ""
    return inspect.cleandoc(doc)


def iter_params(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo, list[type[BaseModel]]]]:
    """(dotted name, field, its sections) for every field of `model`, sections before their fields."""
    for name, field in model.model_fields.items():
        sections = _models_in(field.annotation)
        yield prefix + name, field, sections
        for section in sections:
            yield from iter_params(section, f"{prefix}{name}.")


def _cell(text: str) -> str:
    """Text for one Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _doc_markdown(doc: str) -> str:
    """A docstring as Markdown: prose paragraphs as they are, indented (laid-out) paragraphs as a text block."""
    out = []
    for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        if any(line.startswith((" ", "\t")) for line in para.splitlines()[1:]) or para.startswith(" "):
            out.append("```text\n" + para + "\n```")
        else:
            out.append(para)
    return "\n\n".join(out)


def params_markdown() -> str:
    from schemas.params import Params

    lines = [
        "# Parameters (params.yaml)",
        "",
        "Generated from the pydantic models in `schemas/params/` when the site is built "
        "(`scripts/docs_reference.py`); `smdctl params` prints the effective values. Every key can be "
        "overridden on any command with `-S section.key=value`; an unknown key or an out-of-range value fails "
        "before any stage runs, naming the key.",
        "",
    ]
    top = [(n, f, s) for n, f, s in iter_params(Params) if "." not in n]
    scalars = [(n, f) for n, f, s in top if not s]
    if scalars:
        lines += ["## Top level", "", "| Key | Type | Default | Range | Description |", "|---|---|---|---|---|"]
        lines += [f"| `{n}` | {_cell(_type_name(f.annotation))} | {_default(f)} | {_cell(_constraints(f))} | "
                  f"{_cell(f.description or '')} |" for n, f in scalars]
        lines.append("")
    for name, field, sections in iter_params(Params):
        if not sections:
            continue
        depth = name.count(".")
        lines += [f"{'#' * min(2 + depth, 4)} `{name}`", ""]
        if field.description:
            lines += [field.description, ""]
        if not field.is_required() and field.get_default() is None:
            lines += [f"Optional section: `null` by default (`{name}: {{...}}` sets it).", ""]
        lines += [_doc_markdown(section_doc(sections[0])), ""]
        rows = [(n, f) for n, f, s in iter_params(sections[0], name + ".") if n.count(".") == depth + 1 and not s]
        if rows:
            lines += ["| Key | Type | Default | Range | Description |", "|---|---|---|---|---|"]
            lines += [f"| `{n}` | {_cell(_type_name(f.annotation))} | {_default(f)} | {_cell(_constraints(f))} | "
                      f"{_cell(f.description or '')} |" for n, f in rows]
            lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ commands


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(name path, command) for every leaf command and group of the Typer app's Click tree, groups first."""
    if path:
        yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def smdctl_command() -> Any:
    import typer

    from cli.main import app

    return typer.main.get_command(app)


def cli_markdown() -> str:
    root = smdctl_command()
    lines = [
        "# Commands (smdctl)",
        "",
        "Generated from the Typer app (`cli/main.py`) when the site is built (`scripts/docs_reference.py`): every "
        "command and option as `smdctl COMMAND --help` prints it. Every stage reads `params.yaml` (`-p`) and "
        "takes `-S section.key=value` overrides ([parameters](params.md)).",
        "",
        f"{_cell(root.help or '')}",
        "",
        "| Command | What it does |",
        "|---|---|",
    ]
    entries = list(_commands(root))
    for path, command in entries:
        anchor = "-".join(("smdctl", *path))
        lines.append(f"| [`smdctl {' '.join(path)}`](#{anchor}) | {_cell(command.get_short_help_str(300))} |")
    lines.append("")
    for path, command in entries:
        name = " ".join(path)
        ctx = command.context_class(command, info_name=f"smdctl {name}")
        usage = " ".join(command.collect_usage_pieces(ctx))
        lines += [f"## smdctl {name} {{#{'-'.join(('smdctl', *path))}}}", "", inspect.cleandoc(command.help or ""), ""]
        if hasattr(command, "commands"):
            lines += ["Subcommands: " + ", ".join(f"`{s}`" for s in command.commands), ""]
            continue
        lines += ["```text", f"smdctl {name} {usage}", "```", ""]
        rows = [p.get_help_record(ctx) for p in command.params if not getattr(p, "hidden", False)]
        rows = [r for r in rows if r]
        if rows:
            lines += ["| Option | Description |", "|---|---|"]
            lines += [f"| `{_cell(opt)}` | {_cell(text)} |" for opt, text in rows]
            lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ artifacts


def _schema_rows(schema: Any) -> list[str]:
    rows = ["| Column | Arrow type | Nullable |", "|---|---|---|"]
    rows += [f"| `{f.name}` | `{f.type}` | {'yes' if f.nullable else 'no'} |" for f in schema]
    return rows


def _layout_rows(obj: Any, prefix: str) -> list[str]:
    """One row per path property of a layout dataclass: its name, the path and its docstring."""
    rows = []
    for name, member in inspect.getmembers(type(obj), lambda m: isinstance(m, property)):
        path = getattr(obj, name)
        doc = _cell(inspect.getdoc(member) or "")
        rows.append((str(path), f"| `{path}` | `{prefix}{name}` | {doc} |"))
    return [row for _, row in sorted(rows)]


def artifacts_markdown() -> str:
    import schemas.compacted_masks as compacted
    import schemas.metrics as metrics
    import schemas.raw_masks as raw
    import schemas.tables as tables
    import schemas.weights as weights
    from schemas.compare import CompareSpec
    from schemas.layout import RunLayout

    layout = RunLayout()
    lines = [
        "# Artifact contracts",
        "",
        "Generated from `schemas/` when the site is built (`scripts/docs_reference.py`). Every artifact carries "
        "`schema_version` and the config that produced it, a digest of its data checked on read, and is written "
        "atomically; readers fail with one line naming the file and the field. Inspecting them with pandas: "
        "[guide](../guides/artifacts.md).",
        "",
        "## Where each file lives (`schemas/layout.py`)",
        "",
        "`RunLayout` (one run's `artifacts/`) and `IterationLayout` (its `iter-NNN/`), shown for iteration 1:",
        "",
        "| Path | Layout attribute | Note |",
        "|---|---|---|",
        *_layout_rows(layout, "RunLayout."),
        *_layout_rows(layout.iteration(1), "RunLayout.iteration(n)."),
        "",
        "## Arrow tables (`schemas/tables.py`)",
        "",
        _doc_markdown(tables.__doc__ or ""),
        "",
    ]
    for kind, schema in tables.KINDS.items():
        lines += [f"### `{kind}`", "", *_schema_rows(schema), ""]
        optional = tables.OPTIONAL_FIELDS.get(kind, ())
        if optional:
            lines += ["Optional columns (written only when the table has them): "
                      + ", ".join(f"`{f.name}` (`{f.type}`)" for f in optional) + ".", ""]
    lines += ["## Raw shadow masks (`schemas/raw_masks.py`)", "", _doc_markdown(raw.__doc__ or ""), "",
              "## Compacted shadow masks (`schemas/compacted_masks.py`)", "", _doc_markdown(compacted.__doc__ or ""), "",
              "## Metrics files (`schemas/metrics.py`)", "", _doc_markdown(metrics.__doc__ or ""), "",
              "## Policy weights (`schemas/weights.py`)", "", _doc_markdown(weights.__doc__ or ""), "",
              "## Comparison spec (`schemas/compare.py`)", "", _doc_markdown(sys.modules[CompareSpec.__module__].__doc__
                                                                          or ""), "",
              "| Key | Type | Default | Range | Description |", "|---|---|---|---|---|"]
    lines += [f"| `{n}` | {_cell(_type_name(f.annotation))} | {_default(f)} | {_cell(_constraints(f))} | "
              f"{_cell(f.description or '')} |" for n, f, _ in iter_params(CompareSpec)]
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ design


def slug(title: str) -> str:
    """A design page's name from its section heading: the section number (`3b. Devices` -> `3b`), which stays when
    a heading's words change; a heading without one is slugified."""
    number = re.match(r"(\d+[a-z]?)\.\s", title)
    return number.group(1) if number else re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:60].rstrip("-")


def design_sections(text: str) -> list[tuple[str, str, str]]:
    """docs/design.md as (page slug, title, text) per `## ` section, the text as written (its `## ` heading
    raised to the page's title); what comes before the first section is the overview."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    intro = parts[0].split("\n", 1)[1] if parts[0].startswith("# ") else parts[0]
    out = [("index", "Overview", "# The design as built\n\n" + intro.strip() + "\n")]
    for title, body in zip(parts[1::2], parts[2::2]):
        out.append((slug(title), title.strip(), f"# {title.strip()}\n{body.rstrip()}\n"))
    return out


# ------------------------------------------------------------------ checks


def missing_descriptions() -> list[str]:
    """Every parameter, parameter section, command and visible option that the reference would show without a
    description."""
    from schemas.compare import CompareSpec
    from schemas.params import Params

    missing = []
    for model, where in ((Params, "params"), (CompareSpec, "compare spec")):
        for name, field, sections in iter_params(model):
            if sections and not section_doc(sections[0]).strip():
                missing.append(f"{where}: section {name}")
            elif not sections and not (field.description or "").strip():
                missing.append(f"{where}: {name}")
    for path, command in _commands(smdctl_command()):
        if not (command.help or "").strip():
            missing.append(f"smdctl {' '.join(path)}: no help")
        for param in getattr(command, "params", []):
            if not getattr(param, "hidden", False) and not (getattr(param, "help", None) or "").strip():
                missing.append(f"smdctl {' '.join(path)} {'/'.join(param.opts)}: no help")
    return missing


def main(argv: list[str]) -> int:
    pages = {"params": params_markdown, "cli": cli_markdown, "artifacts": artifacts_markdown}
    if len(argv) == 1 and argv[0] in pages:
        sys.stdout.write(pages[argv[0]]())
        return 0
    if argv == ["missing"]:
        missing = missing_descriptions()
        print("\n".join(missing) or "every parameter, command and option has a description")
        return 1 if missing else 0
    print("usage: docs_reference.py params|cli|artifacts|missing", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
