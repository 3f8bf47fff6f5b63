"""MkDocs hooks (mkdocs.yml `hooks:`): links the site cannot hold, written as text instead of failing the build.

- The results pages link to files such as `../experiments/paper_comparison.yaml`, which GitHub renders and the
  site does not hold; the site writes them as the repository path in code (`experiments/paper_comparison.yaml`).
- The reports archived under docs/results-*/ (`seed_stats.md`, `report.md`, written by `smdctl seed-stats` and
  `smdctl report`) link figures that were not all committed; on those pages only, a link to a missing file becomes
  its text. Every other page's links are checked by `mkdocs build --strict` as usual.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)\s#]+)\)")
_LOCAL = re.compile(r"(!?)\[([^\]]*)\]\(([^):\s#]+)\)")  # a relative link or image, no scheme
_ARCHIVED = re.compile(r"^results-[^/]+/.+\.md$")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    here = (docs / page.file.src_path).parent

    def rewrite(match: re.Match) -> str:
        text, target = match.groups()
        path = (here / target).resolve()
        if path.is_relative_to(docs) or not path.is_relative_to(ROOT):
            return match.group(0)  # a page of the site, or not a repository file: mkdocs checks it as usual
        where = path.relative_to(ROOT).as_posix()
        label = text.strip("`")
        return f"`{where}`" if label == where else f"{text} (`{where}` in the repository)"

    markdown = _LINK.sub(rewrite, markdown)
    if _ARCHIVED.match(page.file.src_path):
        def missing(match: re.Match) -> str:
            image, text, target = match.groups()
            if (here / target).exists():
                return match.group(0)
            return f"{text or target} (not committed)" if image else text
        markdown = _LOCAL.sub(missing, markdown)
    return markdown
