"""mkdocs-gen-files script (mkdocs.yml): writes the site's generated pages at build time, never into docs/.

- reference/params.md, reference/cli.md, reference/artifacts.md: from the code (scripts/docs_reference.py);
- design/*.md and design/SUMMARY.md (the Design section's nav): docs/design.md split at its `## ` sections, each
  section's text as written, so docs/design.md stays the one source of the design;
- changelog.md: CHANGELOG.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.docs_reference import (  # noqa: E402 - the project's root goes on sys.path first
    artifacts_markdown,
    cli_markdown,
    design_sections,
    params_markdown,
)

for name, render in (("params", params_markdown), ("cli", cli_markdown), ("artifacts", artifacts_markdown)):
    with mkdocs_gen_files.open(f"reference/{name}.md", "w") as page:
        page.write(render())
    mkdocs_gen_files.set_edit_path(f"reference/{name}.md", "../scripts/docs_reference.py")

summary = []
for slug, title, text in design_sections((ROOT / "docs" / "design.md").read_text()):
    with mkdocs_gen_files.open(f"design/{slug}.md", "w") as page:
        page.write(text)
    summary.append(f"* [{title}]({slug}.md)")
with mkdocs_gen_files.open("design/SUMMARY.md", "w") as nav:
    nav.write("\n".join(summary) + "\n")

# the changelog page: CHANGELOG.md at the repository root, as written
with mkdocs_gen_files.open("changelog.md", "w") as page:
    page.write((ROOT / "CHANGELOG.md").read_text())
mkdocs_gen_files.set_edit_path("changelog.md", "../CHANGELOG.md")
