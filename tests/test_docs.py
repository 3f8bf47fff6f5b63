"""The docs (issue 56): the reference is generated from the code and complete, every parameter, command and option
has a description, the site builds with `mkdocs build --strict`, the README stays short and every command block in it
is one the tests run, and the figures' command works and keeps the committed DAG current."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from schemas.compare import CompareSpec
from schemas.params import Params
from scripts.docs_reference import (
    _commands,
    artifacts_markdown,
    cli_markdown,
    design_sections,
    iter_params,
    missing_descriptions,
    params_markdown,
    smdctl_command,
)
from scripts.readme_commands import ANCHORS, block, command
from tests.helpers import ROOT

README_MAX_LINES = 150


def test_every_parameter_command_and_option_has_a_description():
    assert missing_descriptions() == []


def test_a_missing_description_is_reported(monkeypatch):
    field = Params.model_fields["seed"]
    monkeypatch.setattr(field, "description", None)
    root = smdctl_command()
    option = next(p for p in root.commands["compare"].params if p.name == "arms")
    monkeypatch.setattr(option, "help", None)
    monkeypatch.setattr("scripts.docs_reference.smdctl_command", lambda: root)
    missing = missing_descriptions()
    assert "params: seed" in missing and "smdctl compare --arms: no help" in missing


def test_the_parameter_reference_lists_every_parameter_with_its_default_and_range():
    page = params_markdown()
    for name, _, _ in iter_params(Params):
        assert f"`{name}`" in page, name
    assert "| `seed` | int | `0` | >= 0 |" in page
    assert "| `learner.lora.dropout` | float | `0.0` | >= 0.0, < 1.0 |" in page


def test_the_artifact_reference_lists_every_table_column_and_compare_spec_key():
    from schemas.tables import KINDS, OPTIONAL_FIELDS

    page = artifacts_markdown()
    for kind, schema in KINDS.items():
        assert f"### `{kind}`" in page
        assert all(f"`{field.name}`" in page for field in [*schema, *OPTIONAL_FIELDS[kind]])
    assert all(f"| `{name}` |" in page for name, _, _ in iter_params(CompareSpec))
    assert "`artifacts/iter-001/compact/masks.zarr`" in page


def test_the_command_reference_lists_every_command_and_option():
    page = cli_markdown()
    for path, command_ in _commands(smdctl_command()):
        assert f"## smdctl {' '.join(path)} " in page
        for param in getattr(command_, "params", []):
            if not getattr(param, "hidden", False):
                assert any(opt in page for opt in param.opts), (path, param.opts)
    assert "--eval-every <int range>" in page and "--local-rank" not in page  # hidden options stay hidden


def test_the_design_pages_hold_design_md_as_written():
    text = (ROOT / "docs" / "design.md").read_text()
    pages = design_sections(text)
    slugs = [slug for slug, _, _ in pages]
    assert len(slugs) == len(set(slugs)) and slugs[0] == "index"
    assert len(pages) == 1 + len(re.findall(r"^## ", text, flags=re.M))
    body = "\n".join(page for _, _, page in pages)
    for line in text.splitlines()[1:]:  # every line but the title, in a page (a `## ` heading as its title)
        assert (line in body) or (line.startswith("## ") and "# " + line[3:] in body), line


def test_the_getting_started_page_shows_the_readmes_commands_as_written():
    page = (ROOT / "docs" / "getting-started.md").read_text()
    assert block(page, "From a clean clone on a fresh machine") == command("main")
    assert block(page, "The tests, as CI runs them") == command("tests")
    assert "docs]'" in command("tests")  # the test command installs the docs extra (mkdocs for this module)


def test_the_readme_is_short_and_every_command_block_in_it_is_run():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    blocks = re.findall(r"(?:^|\n\n)((?:    .*\n|[ \t]*\n(?=    ))+)", text)
    run = {command(name).strip() for name in ANCHORS}
    for code in blocks:
        script = "\n".join(line[4:] for line in code.rstrip("\n").splitlines()).strip()
        assert script in run, f"a README code block no test runs:\n{script}"
    assert len(blocks) == len(ANCHORS)


def test_the_figures_command_writes_every_figure_and_the_committed_dag_is_current(tmp_path):
    from scripts.make_figures import main

    assert main(["--out", str(tmp_path)]) == 0
    for name in ("pipeline.mmd", "shadow_mask.png", "learning_curves.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    committed = ROOT / "docs" / "figures" / "pipeline.mmd"
    assert (tmp_path / "pipeline.mmd").read_text() == committed.read_text(), (
        "docs/figures/pipeline.mmd is stale: run `python scripts/make_figures.py`")


def test_the_site_builds_with_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocs_gen_files") is None:
        pytest.skip("the docs extra is not installed (.venv/bin/pip install -e '.[docs]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    params = (site / "reference" / "params" / "index.html").read_text()
    assert "learner.kl_lambda" in params and "rollout.eviction.keep_ratio" in params
    assert "smdctl compare" in (site / "reference" / "cli" / "index.html").read_text()
    assert (site / "design" / "3" / "index.html").is_file() and (site / "changelog" / "index.html").is_file()
    assert not (site / "design.md").exists() and (site / "figures" / "shadow_mask.png").is_file()
