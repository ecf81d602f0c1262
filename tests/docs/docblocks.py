"""The fenced code blocks of a Markdown page: their language, their doc-test marker, their code.

A page's `bash`, `console` and `python` blocks run in document order, in one fresh directory per
page (`examples/` is linked into it, so `examples/configs/tiny.toml` works as written). A block
may be marked on the line right before its fence:

    <!-- doc-test: skip (why it cannot run here) -->   not run; the reason is required
    <!-- doc-test: fails -->                           a `console` block whose commands must all
                                                       exit non-zero, printing the lines it shows

`console` blocks: a line starting with `$ ` is a command; the lines after it, up to the next
command, are output that must appear in that command's output, in order, as whole lines (`...`
stands for any text; a line of just `...` is skipped).
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_LANGS = ("bash", "console", "python")

_MARKER = re.compile(r"^<!--\s*doc-test:\s*(?P<kind>[a-z-]+)\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")
_FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str = ""  # "", "skip" or "fails"
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN_LANGS and self.marker != "skip"


class PageError(ValueError):
    """A page whose fences or markers are malformed."""


def prose_lines(path: Path) -> list[str]:
    """The page's lines outside fenced blocks."""
    lines, fence = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        mark = re.match(r"^(```+|~~~+)", line)
        if fence:
            fence = "" if line.strip() == fence else fence
        elif mark:
            fence = mark.group(1)
        else:
            lines.append(line)
    return lines


def parse(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    pending: tuple[int, str, str] | None = None  # marker line, kind, reason
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line.strip())
        fence = _FENCE.match(line)
        if marker:
            kind, reason = marker["kind"], (marker["reason"] or "").strip()
            if kind not in ("skip", "fails") or (kind == "skip" and not reason):
                raise PageError(f"{path.name}:{i + 1}: a marker is `doc-test: skip (reason)` or `doc-test: fails`")
            pending = (i + 1, kind, reason)
        elif fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence["fence"]), None)
            if end is None:
                raise PageError(f"{path.name}:{i + 1}: the fence is never closed")
            kind, reason = ("", "") if pending is None else pending[1:]
            found.append(Block(path, i + 1, fence["lang"], "\n".join(lines[i + 1:end]) + "\n", kind, reason))
            if kind == "fails" and fence["lang"] != "console":
                raise PageError(f"{path.name}:{i + 1}: `doc-test: fails` is for console blocks (they show the output)")
            pending = None
            i = end
        elif pending is not None and line.strip():
            raise PageError(f"{path.name}:{pending[0]}: a doc-test marker must be the line right before a fence")
        i += 1
    if pending is not None:
        raise PageError(f"{path.name}:{pending[0]}: a doc-test marker with no fence after it")
    return found


def _strip_shell_comment(line: str) -> str:
    quote = ""
    for k, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip()
    return line.rstrip()


def normalized(block: Block) -> str:
    """The block's code without comments or trailing blanks: two blocks that differ only in comments
    (the English and Chinese READMEs) normalise to the same text."""
    if block.lang == "python":
        try:
            tokens = [t for t in tokenize.generate_tokens(io.StringIO(block.text).readline)
                      if t.type != tokenize.COMMENT]
            text = tokenize.untokenize(tokens)
        except (tokenize.TokenError, SyntaxError, IndentationError):
            text = block.text
        lines = [ln.rstrip() for ln in text.splitlines()]
    elif block.lang in ("bash", "console", "sh"):
        lines = [_strip_shell_comment(ln) for ln in block.text.splitlines()]
    else:
        lines = [ln.rstrip() for ln in block.text.splitlines()]
    return "\n".join(ln for ln in lines if ln.strip())
