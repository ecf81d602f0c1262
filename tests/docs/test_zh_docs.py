"""The Chinese pages (README.zh-CN.md, docs/zh-CN/*.md) say what the English ones say, in one set of terms.

- parity: a docs/zh-CN/X.md with an English docs/X.md has the same runnable blocks (language,
  doc-test marker, text: byte for byte) and the same sequence of `##`/`###` headings. A page
  translated in part (PARTIAL) has a prefix of the blocks and at most as many `##` headings;
- glossary: no Chinese page uses a term that docs/zh-CN/glossary.md lists under “不用” (outside
  code, links and doc-test markers), and none has the bare English word “worker” in its prose;
- links: every relative link resolves; a link from a Chinese page to an English docs page is
  followed by （英文）, and goes to the Chinese page instead when docs/zh-CN/ has one.

Pure text checks: no subprocess (the blocks themselves run in test_docs_run.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docblocks import REPO, parse, prose_lines

ZH_DIR = REPO / "docs" / "zh-CN"
GLOSSARY = ZH_DIR / "glossary.md"
ZH_PAGES = [REPO / "README.zh-CN.md", *sorted(ZH_DIR.glob("*.md"))]
PARTIAL = {"checkpoint.md"}  # translated from the top down: its blocks are a prefix of the English page's
ENGLISH_MARK = "（英文）"

_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{2,6}) \S")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def prose(path: Path) -> str:
    """What a reader reads as text: no fences, code spans, link targets or doc-test markers; lines
    joined with a space, as Markdown renders a soft line break."""
    text = _COMMENT.sub(" ", " ".join(ln.strip() for ln in prose_lines(path)))
    text = _CODE_SPAN.sub(" ", text)
    return _LINK.sub(lambda m: m.group(1), text)


# --- parity -------------------------------------------------------------------------------------

def runnable(path: Path) -> list[tuple[str, str, str]]:
    return [(b.lang, b.marker, b.text) for b in parse(path) if b.runs]


def heading_levels(path: Path) -> list[int]:
    return [len(m.group(1)) for line in prose_lines(path) if (m := _HEADING.match(line))]


def parity_problems(english: Path, chinese: Path, partial: bool = False) -> list[str]:
    en, zh = runnable(english), runnable(chinese)
    problems = []
    if (zh != en[: len(zh)]) if partial else (zh != en):
        k = next((k for k, (a, b) in enumerate(zip(en, zh, strict=False)) if a != b), min(len(en), len(zh)))
        want = en[k] if k < len(en) else "(nothing)"
        got = zh[k] if k < len(zh) else "(nothing)"
        problems.append(f"{_rel(chinese)}: runnable block {k + 1} differs from {_rel(english)}'s"
                        f" ({len(en)} there, {len(zh)} here):\nEnglish: {want}\nChinese: {got}")
    en_h, zh_h = heading_levels(english), heading_levels(chinese)
    if partial:
        if zh_h.count(2) > en_h.count(2):
            problems.append(f"{_rel(chinese)}: {zh_h.count(2)} `##` headings, more than {_rel(english)}'s {en_h.count(2)}")
    elif zh_h != en_h:
        problems.append(f"{_rel(chinese)}: headings {zh_h} differ from {_rel(english)}'s {en_h}")
    return problems


TRANSLATED = [p for p in ZH_PAGES[1:] if (REPO / "docs" / p.name).exists()]


def test_the_translations_are_found():
    assert {"errors.md", "diagnose.md", "doctor.md"} <= {p.name for p in TRANSLATED}


@pytest.mark.parametrize("page", TRANSLATED, ids=_rel)
def test_same_blocks_and_headings_as_the_english_page(page: Path):
    problems = parity_problems(REPO / "docs" / page.name, page, page.name in PARTIAL)
    assert not problems, "\n".join(problems)


def test_parity_sees_a_command_block_the_chinese_page_lacks(tmp_path: Path):
    en, zh = tmp_path / "en.md", tmp_path / "zh.md"
    en.write_text((REPO / "docs" / "doctor.md").read_text(encoding="utf-8"), encoding="utf-8")
    zh.write_text((ZH_DIR / "doctor.md").read_text(encoding="utf-8"), encoding="utf-8")
    assert parity_problems(en, zh) == []
    with en.open("a", encoding="utf-8") as f:
        f.write("\n```bash\nmeshrun doctor --skip-smoke\n```\n")
    assert parity_problems(en, zh) and "runnable block 2" in parity_problems(en, zh)[0]
    assert parity_problems(en, zh, partial=True) == []  # a part: still a prefix
    zh.write_text(zh.read_text(encoding="utf-8").replace("meshrun doctor  ", "meshrun doctr  "), encoding="utf-8")
    assert parity_problems(en, zh, partial=True)  # but not a changed block


def test_parity_sees_a_missing_heading(tmp_path: Path):
    zh = tmp_path / "zh.md"
    text = (ZH_DIR / "doctor.md").read_text(encoding="utf-8")
    zh.write_text(re.sub(r"^## .*\n", "", text, count=1, flags=re.M), encoding="utf-8")
    assert parity_problems(REPO / "docs" / "doctor.md", zh)


# --- glossary -----------------------------------------------------------------------------------

def glossary() -> list[tuple[str, list[str], list[str]]]:
    """(term, terms not to use, allowed phrases that contain one) for each row of the glossary's table."""
    rows = []
    for line in prose_lines(GLOSSARY):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 4 or cells[0] in ("中文", "") or set(cells[0]) <= set("-: "):
            continue
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[2]), re.findall(r"`([^`]+)`", cells[3])))
    return rows


def _hit(term: str, text: str) -> re.Match | None:
    if term.isascii() and term.isalpha():  # an English word: whole words, any case, plural too
        return re.search(rf"(?<![A-Za-z_-]){re.escape(term)}s?(?![A-Za-z_])", text, re.IGNORECASE)
    return re.search(re.escape(term), text)


def term_problems(page: Path) -> list[str]:
    text = prose(page)
    problems = []
    for term, avoid, allowed in glossary():
        cleaned = text
        for phrase in allowed:
            cleaned = cleaned.replace(phrase, " ")
        for wrong in avoid:
            if m := _hit(wrong, cleaned):
                around = cleaned[max(0, m.start() - 25): m.end() + 25]
                problems.append(f"{_rel(page)}: {m.group(0)!r} where the glossary says {term!r}: ...{around}...")
    return problems


def test_the_glossary_is_read():
    rows = {term: avoid for term, avoid, _ in glossary()}
    assert "挂起" in rows["挂死"] and "激活检查点" in rows["激活重计算"] and "其它" in rows["其他"]
    assert "教程" in rows["指南"] and "worker" in rows["工作进程"]  # the bare English word in prose


@pytest.mark.parametrize("page", ZH_PAGES, ids=_rel)
def test_chinese_pages_use_the_glossary_terms(page: Path):
    problems = term_problems(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("wrong", ["作业挂起时", "可选激活检查点", "见教程", "其它 rank", "FSDP 的 worker 会", "「常见启动错误速诊」"])
def test_a_wrong_term_is_found(wrong: str, tmp_path: Path):
    page = tmp_path / "scratch.md"
    page.write_text(f"# 试\n\n每个 rank {wrong}，见 `挂起 worker 其它`。\n\n```bash\necho 挂起 worker\n```\n", encoding="utf-8")
    problems = term_problems(page)
    assert problems and all(_rel(page) in p for p in problems), problems
    page.write_text("# 试\n\n作业挂死时，按“指南”和官方的 DDP\n教程处理，见 `挂起 worker`、`--workers 2`。\n", encoding="utf-8")
    assert term_problems(page) == []  # code spans, and the glossary's allowed phrase (across a line break)


# --- links --------------------------------------------------------------------------------------

def link_problems(page: Path, docs: Path = REPO / "docs") -> list[str]:
    """`docs`: the English pages' folder; the Chinese pages are in its zh-CN/."""
    text = _CODE_SPAN.sub(" ", "\n".join(prose_lines(page)))
    problems = []
    for m in _LINK.finditer(text):
        target = m.group(2)
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        where = f"{_rel(page)}: [{m.group(1)}]({target})"
        if not path.exists():
            problems.append(f"{where}: no such file")
            continue
        # the page's own English original (its opening note, or where a part-translated page goes on)
        original = text[: m.start()].rstrip().endswith("English:") or (
            page.parent.name == "zh-CN" and path == (docs / page.name).resolve())
        if path.parent == docs.resolve() and path.suffix == ".md" and not original:
            chinese = docs / "zh-CN" / path.name
            if chinese.exists() and not ("#" in target and path.name in PARTIAL):
                problems.append(f"{where}: link the Chinese page, {_rel(chinese)}")
            elif not text[m.end():].lstrip().startswith(ENGLISH_MARK):
                problems.append(f"{where}: an English page: add {ENGLISH_MARK} after the link")
    return problems


@pytest.mark.parametrize("page", ZH_PAGES, ids=_rel)
def test_links_resolve_and_say_when_they_lead_to_english(page: Path):
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("link", "wrong"), [
    ("[config.md](../config.md)（英文）", False),
    ("[config.md](../config.md)", True),                 # English, unmarked
    ("[doctor.md](../doctor.md)（英文）", True),           # a Chinese page exists
    ("[doctor.md](doctor.md)", False),
    ("[nothing.md](nothing.md)", True),                  # no such file
])
def test_a_bad_link_is_found(link: str, wrong: bool, tmp_path: Path):
    for name in ("config.md", "doctor.md", "zh-CN/doctor.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("# x\n", encoding="utf-8")
    page = tmp_path / "zh-CN" / "page.md"
    page.write_text(f"English: [../page.md](../config.md)\n\n见 {link}。\n", encoding="utf-8")
    assert bool(link_problems(page, tmp_path)) == wrong, link_problems(page, tmp_path)
