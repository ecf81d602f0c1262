"""Rebuild corpus.txt.gz, the built-in training text, from the docstrings of Python's standard library.

    python src/meshrun/data/corpus/build_corpus.py                  # this interpreter's stdlib
    python src/meshrun/data/corpus/build_corpus.py --stdlib /usr/lib/python3.11 --max-bytes 2000000

Reads the stdlib's .py files as text (ast, nothing is imported), keeps the prose paragraphs of
module, class and function docstrings (no code, no doctests, no signatures, no duplicates),
groups them by module, shuffles the modules with a fixed seed (so the held-out tail is a fair
sample, not the modules that sort last), and writes them gzip-compressed with a zero mtime:
the same stdlib gives the same bytes. It also copies the stdlib's LICENSE.txt next to it.
The text is (c) the Python Software Foundation, under the PSF License Agreement; see README.md.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import random
import re
import shutil
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "_bundled",
             "turtledemo", "lib2to3", "config-3"}
DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
MIN_CHARS, MIN_WORDS, MIN_PROSE_RATIO = 60, 8, 0.85
CODE_MARKS = (">>>", "->", "==", "__", "::", "${", "<==>")


def prose_paragraphs(docstring: str) -> list[str]:
    """The paragraphs of a docstring that read as English sentences, each joined onto one line."""
    out = []
    for para in re.split(r"\n\s*\n", docstring):
        lines = para.split("\n")
        if any(line.startswith((" ", "\t")) for line in lines):  # indented: code, tables, lists
            continue
        text = re.sub(r"\s+", " ", para).strip()
        if len(text) < MIN_CHARS or len(text.split()) < MIN_WORDS or not text.isascii():
            continue
        if any(mark in text for mark in CODE_MARKS) or "copyright" in text.lower():
            continue
        if sum(c.isalpha() or c == " " for c in text) / len(text) < MIN_PROSE_RATIO:
            continue
        if not text[0].isupper() or text[-1] not in ".!?:":
            continue
        out.append(text)
    return out


def module_text(path: Path, seen: set[str]) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    paras = []
    for node in ast.walk(tree):
        if isinstance(node, DOC_NODES) and (doc := ast.get_docstring(node)):
            for text in prose_paragraphs(doc):
                if text not in seen:
                    seen.add(text)
                    paras.append(text)
    return "\n".join(paras)


def build(stdlib: Path, max_bytes: int, seed: int) -> str:
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not any(part in SKIP_DIRS or part.startswith("config-")
                              for part in p.relative_to(stdlib).parts))
    seen: set[str] = set()
    modules = [t for t in (module_text(p, seen) for p in files) if t]
    random.Random(seed).shuffle(modules)
    out, size = [], 0
    for text in modules:
        if size + len(text) + 2 > max_bytes:
            break
        out.append(text)
        size += len(text) + 2
    return "\n\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                        help="the standard library folder to read (default: this interpreter's)")
    parser.add_argument("--out", type=Path, default=HERE / "corpus.txt.gz", help="output .txt.gz file")
    parser.add_argument("--max-bytes", type=int, default=2_000_000,
                        help="stop adding modules past this many bytes of text (default 2000000)")
    parser.add_argument("--seed", type=int, default=0, help="module shuffle seed (default 0)")
    args = parser.parse_args(argv)
    text = build(args.stdlib, args.max_bytes, args.seed)
    with args.out.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                   compresslevel=9) as f:
        f.write(text.encode("utf-8"))
    license_src = args.stdlib / "LICENSE.txt"
    if license_src.is_file():
        shutil.copyfile(license_src, args.out.parent / "LICENSE-PSF.txt")
    print(f"{args.out}: {len(text):,} characters, {text.count(chr(10) * 2) + 1} modules, "
          f"{args.out.stat().st_size:,} bytes compressed, from {args.stdlib} "
          f"(Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
