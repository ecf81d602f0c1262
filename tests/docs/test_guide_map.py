"""docs/guide-map.md and docs/zh-CN/guide-map.md map every section of the guide, in both languages.

The guide (the Chinese getting-started guide the README names) is not part of the repository, so
its section headings are kept in docs/zh-CN/guide-headings.txt, one per line, in the guide's
order. Where the guide itself is at hand (`seed-guide-zh.txt` in a `shared` folder beside the
repository), that list is checked against it, so the copy cannot drift: every heading is found in
the guide in the same order, and every standalone heading line of the guide is on the list. (One
heading, the DDP section's, is glued to the end of a code line in the guide's text; the list
holds it as written and the check finds it inside that line.)

Each map page must give every heading a row of its table (the first cell starts with the heading
as the guide writes it) with a command to run in it, and mention `make guide`. Pure text: no
process is started.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO.parent / "shared" / "seed-guide-zh.txt"
HEADINGS = REPO / "docs" / "zh-CN" / "guide-headings.txt"
MAPS = [REPO / "docs" / "guide-map.md", REPO / "docs" / "zh-CN" / "guide-map.md"]

_CJK = re.compile(r"[\u4e00-\u9fff]")
_NOT_A_HEADING = re.compile(r"[()=#|.,;`\"'\[\]{}，。；、（）]")  # code, tables and prose have these
_RUNNABLE = re.compile(r"`(?:meshrun|make|python) [^`]+`")


def headings() -> list[str]:
    return [line.strip() for line in HEADINGS.read_text(encoding="utf-8").splitlines() if line.strip()]


def standalone_headings(guide: str) -> list[str]:
    """The guide's lines that are a heading alone: short, Chinese, no code or prose punctuation."""
    found = []
    for line in guide.splitlines():
        text = line.strip()
        if 0 < len(text) <= 30 and _CJK.search(text) and not text.startswith("-") and not _NOT_A_HEADING.search(text):
            found.append(text)
    return found


def drift(guide: str, listed: list[str]) -> list[str]:
    """How the checked-in list differs from the guide; empty when it matches."""
    problems, at = [], 0
    for heading in listed:
        where = guide.find(heading, at)
        if where < 0:
            problems.append(f"{heading!r} is not in the guide (after the previous heading)")
        else:
            at = where + len(heading)
    lines = {line.strip() for line in guide.splitlines()}
    on_own_line = [h for h in listed if h in lines]
    if standalone_headings(guide) != on_own_line:
        problems.append(f"the guide's own heading lines {standalone_headings(guide)} != the list's {on_own_line}")
    return problems


def table_rows(page: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in page.splitlines() if line.startswith("| ")]


def unmapped(page: str, listed: list[str]) -> list[str]:
    """The headings that have no table row of their own, with something to run, on the page."""
    rows = table_rows(page)
    return [h for h in listed
            if not any(row[0].startswith(h) and _RUNNABLE.search(row[-1]) for row in rows)]


def test_the_heading_list_is_whole():
    listed = headings()
    assert len(listed) >= 8 and len(set(listed)) == len(listed), listed
    assert listed[0] == "入门" and listed[-1] == "常见启动错误速诊"  # the title, then the sections to the last


def test_the_heading_list_matches_the_guide():
    if not GUIDE.is_file():
        pytest.skip("the guide is not beside this checkout; the checked-in list stands for it")
    assert drift(GUIDE.read_text(encoding="utf-8"), headings()) == []


@pytest.mark.parametrize("page", MAPS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_map_gives_every_section_a_row(page: Path):
    text = page.read_text(encoding="utf-8")
    assert unmapped(text, headings()) == []
    assert "`make guide`" in text


def run_lines(page: str) -> set[str]:
    return {cmd for row in table_rows(page) for cmd in _RUNNABLE.findall(row[-1])}


def test_both_maps_give_the_same_lines_to_run():
    english, chinese = (run_lines(p.read_text(encoding="utf-8")) for p in MAPS)
    assert english == chinese and len(english) >= 8, english ^ chinese


def test_the_english_map_links_only_what_exists():
    page = MAPS[0]
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8"))
    missing = [t for t in targets if not t.startswith("http") and not (page.parent / t.split("#")[0]).exists()]
    assert targets and not missing, missing


def test_make_guide_runs_the_ddp_example():
    assert re.search(r"^guide:.*\n\t.*meshrun launch examples/guide/train_ddp\.py", (REPO / "Makefile").read_text(), re.M)


# --- the checks must be able to fail: scratch copies, changed one way each ---

@pytest.mark.parametrize("page", MAPS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_section_left_out_of_a_map_is_named(page: Path, tmp_path: Path):
    gone = "看一眼 DTensor 与 DeviceMesh"
    text = page.read_text(encoding="utf-8")
    scratch = tmp_path / page.name
    scratch.write_text("\n".join(line for line in text.splitlines() if not line.startswith(f"| {gone}")), encoding="utf-8")
    assert unmapped(scratch.read_text(encoding="utf-8"), headings()) == [gone]
    no_command = text.replace("`meshrun launch --nproc-per-node 2 examples/guide/dtensor_mesh.py` |\n", "|\n", 1)
    assert no_command != text and unmapped(no_command, headings()) == [gone]  # a row without a command is no map


def test_a_guide_that_changed_is_seen():
    listed = headings()
    guide = GUIDE.read_text(encoding="utf-8") if GUIDE.is_file() else "\n".join(f"{h}\n正文，一段说明。" for h in listed)
    assert drift(guide, listed) == []
    added = guide + "\n附录：多机实战\n正文，一段说明。\n"  # a new section at the end
    assert drift(added, listed) and "附录：多机实战" in drift(added, listed)[0]
    renamed = guide.replace("进阶一步：FSDP2 最小改造", "进阶：FSDP2", 1)
    assert any("进阶一步：FSDP2 最小改造" in p for p in drift(renamed, listed))
    reordered = listed[:2] + [listed[3], listed[2]] + listed[4:]
    assert drift(guide, reordered)
