"""What a newcomer tripped on in the docs: the guide unnamed, pointers outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "README.zh-CN.md", *sorted((REPO / "docs").glob("*.md"))]


def test_both_readmes_say_what_the_guide_is():
    english = (REPO / "README.md").read_text(encoding="utf-8")
    chinese = (REPO / "README.zh-CN.md").read_text(encoding="utf-8")
    assert '"The guide"' in english and "Chinese getting-started guide to PyTorch 2.13" in english
    assert "“指南”指" in chinese and "PyTorch 2.13 分布式训练入门指南" in chinese


OUTSIDE = re.compile(r"\.\./shared|FIELD-NOTES|STYLE\.md|STYLE point|DEVELOPERS\.md|\bissues? #?\d+|\(#\d+\)",
                     re.IGNORECASE)
CODE = [p for folder in ("src", "tests", "benchmarks", "examples") for p in sorted((REPO / folder).rglob("*.py"))
        if p != Path(__file__).resolve()]


def test_docs_point_only_inside_the_repository():
    """No page sends a reader to a notes file outside the repository or to an issue number."""
    found = [f"{page.name}:{n}: {line.strip()}" for page in PAGES
             for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, found


def test_code_comments_point_only_inside_the_repository():
    """Docstrings and comments cite a module, a doc page or a test, never an issue or a notes file."""
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in CODE
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)


def test_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md does not link {missing}"
