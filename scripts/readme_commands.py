"""The README's commands as written, for CI and the tests (issue 41): nothing runs a copy that could drift.

    python3 scripts/readme_commands.py main      # the README's first command (the default experiment)
    python3 scripts/readme_commands.py tests     # the README's test command (what CI runs)
    python3 scripts/readme_commands.py check-summary N < summary.txt   # exit 1 unless rows 1..N are printed

A block is an indented code block (4 spaces) of README.md; `block(text, after)` is the first one after the
paragraph that contains `after` (a piece of its text). `summary_iterations` reads `smdctl summary`'s table: the
iterations with a row that shows at least one figure. Standard library only: `.ci/run` calls it before any
virtual environment exists.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
# Where each named command is: the first code block after a paragraph containing this text.
ANCHORS = {
    "main": "Run the default experiment",
    "tests": "Run the tests",
    "your_data": "The worked example, a 20-row verl file",
    "your_model": "The whole\npath, from the repository root",
}


def block(text: str, after: str) -> str:
    """The first indented code block after the text `after` (line breaks in `after` match any whitespace), as a
    shell script: the 4-space indent removed, continuation lines kept."""
    pattern = r"\s+".join(re.escape(part) for part in after.split())
    found = re.search(pattern, text)
    if found is None:
        raise ValueError(f"README.md: no paragraph containing {after!r}")
    rest = text[found.end():]
    code = re.search(r"\n\n((?:    .*\n|[ \t]*\n(?=    ))+)", rest)
    if code is None:
        raise ValueError(f"README.md: no code block after {after!r}")
    return "\n".join(line[4:] for line in code.group(1).rstrip("\n").splitlines()) + "\n"


def command(name: str, text: str | None = None) -> str:
    """The README's command `name` (ANCHORS), as written."""
    return block(README.read_text() if text is None else text, ANCHORS[name])


def summary_iterations(output: str) -> set[int]:
    """The iterations `smdctl summary` printed a row for (its first cell a number and at least one figure)."""
    rows = set()
    for line in output.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line)]
        cells = [c for c in cells if c]
        if len(cells) >= 2 and cells[0].isdigit() and any(re.fullmatch(r"-?[\d.]+(e[-+]?\d+)?", c) for c in cells[1:]):
            rows.add(int(cells[0]))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) == 1 and argv[0] in ANCHORS:
        sys.stdout.write(command(argv[0]))
        return 0
    if len(argv) == 2 and argv[0] == "check-summary" and argv[1].isdigit():
        want = set(range(1, int(argv[1]) + 1))
        missing = sorted(want - summary_iterations(sys.stdin.read()))
        if missing:
            print(f"smdctl summary: no row for iteration(s) {', '.join(map(str, missing))} of {len(want)}",
                  file=sys.stderr)
            return 1
        print(f"smdctl summary: a row for each of the {len(want)} iterations")
        return 0
    print("usage: readme_commands.py main|tests|your_data|your_model | check-summary N", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
