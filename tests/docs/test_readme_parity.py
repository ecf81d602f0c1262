"""README.zh-CN.md says what README.md says: the same sections, the same commands, the same links.

Headings differ in language, so their levels are compared; code blocks that run (bash, console,
python) must be identical up to comments, with the same doc-test markers; the other blocks must
have the same languages; link targets must be the same set (each README links the other; a
docs/zh-CN/ translation stands for its English page); and the
commands quoted in prose (inline code starting with `meshrun ` or `make `) must be the same set.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docblocks import REPO, RUN_LANGS, normalized, parse, prose_lines

EN, ZH = REPO / "README.md", REPO / "README.zh-CN.md"
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_INLINE_COMMAND = re.compile(r"`((?:meshrun|make) [^`]+)`")


def headings(path: Path) -> list[int]:
    return [len(m.group(1)) for line in prose_lines(path) if (m := re.match(r"^(#{1,6}) \S", line))]


def links(path: Path) -> set[str]:
    return {target for line in prose_lines(path) for target in _LINK.findall(line)}


def inline_commands(path: Path) -> set[str]:
    return {" ".join(cmd.split()) for line in prose_lines(path) for cmd in _INLINE_COMMAND.findall(line)}


def code(path: Path) -> list[tuple]:
    return [(b.lang, b.marker, b.reason, normalized(b) if b.lang in RUN_LANGS else "") for b in parse(path)]


def test_same_heading_structure():
    assert headings(ZH) == headings(EN)
    assert len(headings(EN)) >= 5  # the parser finds the sections at all


def test_same_code_blocks_up_to_comments():
    en, zh = code(EN), code(ZH)
    assert len(zh) == len(en), f"{len(en)} blocks in README.md, {len(zh)} in README.zh-CN.md"
    for k, (a, b) in enumerate(zip(en, zh, strict=True)):
        assert a == b, f"code block {k + 1} differs (README.md vs README.zh-CN.md):\n{a}\n---\n{b}"


def test_same_links_and_each_links_the_other():
    """README.zh-CN.md links a page's Chinese translation (docs/zh-CN/X.md) where README.md links docs/X.md."""
    en, zh = links(EN), {target.replace("docs/zh-CN/", "docs/", 1) for target in links(ZH)}
    assert "README.zh-CN.md" in en and "README.md" in zh
    assert en - {"README.zh-CN.md"} == zh - {"README.md"}
    for target in links(EN) | links(ZH):  # and the targets exist
        assert target.startswith("http") or (REPO / target.split("#")[0]).exists(), target


def test_same_commands_inprose_lines():
    assert inline_commands(ZH) == inline_commands(EN)


@pytest.mark.parametrize("helper", [headings, links, inline_commands, code])
def test_the_comparison_sees_a_difference(helper, tmp_path: Path):
    """A comparison that cannot fail is no check: dropping the last section of README.md must show."""
    text = EN.read_text(encoding="utf-8")
    cut = tmp_path / "README.md"
    cut.write_text(text[: text.index("\n## Test distributed code")] + "\n", encoding="utf-8")
    assert helper(cut) != helper(EN)
