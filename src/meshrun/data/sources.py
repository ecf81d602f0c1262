"""The inputs of `meshrun data prepare`: text, JSON lines, Parquet and `datasets` save_to_disk
directories, read as a stream of `Batch`es of documents (never a whole dataset in memory).

    src = open_source("data/train.jsonl")   # meshrun.data.prepare picks the reader by path
    src.check("text")                       # the field exists and holds text, else one DataError line
    for batch in src.batches(0, "text"):    # about 1 MB of documents at a time
        texts = batch.documents()

A .txt file is one document, read in pieces cut at line ends. A .jsonl/.json/.ndjson file is one
JSON object per line, parsed in `Batch.documents` (so in the encoding workers). Parquet files and
`datasets` directories are in meshrun.data.arrow_sources. Empty and null texts are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_CHUNK_CHARS = 8 << 20  # a .txt file is encoded in pieces of about this many characters
BATCH_CHARS = 1 << 20  # documents per unit of work: about this many characters ...
BATCH_DOCS = 4096  # ... or this many documents, whichever comes first


@dataclass
class Batch:
    """One unit of encoding work: texts (or raw JSON lines to parse first), in input order.

    `eos`: put the end-of-text token after each text (False only inside a .txt file).
    `done_bytes`: how far into its source the reading is once this batch is in (progress).
    """

    source: int
    done_bytes: int
    texts: list[str] = field(default_factory=list)
    eos: bool = True
    lines: list[bytes] = field(default_factory=list)
    first_line: int = 0
    path: str = ""
    text_field: str = ""

    def documents(self) -> list[str]:
        return self.texts + parse_json_lines(self.lines, self.first_line, self.path, self.text_field)


def fields_hint(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:20]) + (", ..." if len(names) > 20 else "")
    return f"(its fields: {shown or 'none'}); choose one with --text-field"


def json_object_line(line: bytes, where: str) -> dict:
    """One .jsonl line as its object; DataError naming `where` ("FILE line N") otherwise."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{where} is not JSON ({exc}); a .jsonl file holds one JSON object per line") from None
    if not isinstance(record, dict):
        raise DataError(f"{where} is a JSON {type(record).__name__}, not an object; "
                        "a .jsonl file holds one JSON object per line")
    return record


def parse_json_lines(lines: list[bytes], first_line: int, path: str, text_field: str) -> list[str]:
    """The `text_field` of each JSON object line; blank lines and empty/null texts are skipped."""
    texts = []
    for n, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        record = json_object_line(line, f"{path} line {n}")
        if text_field not in record:
            raise DataError(f"{path} line {n} has no field {text_field!r} {fields_hint(list(record))}")
        value = record[text_field]
        if value is not None and not isinstance(value, str):
            raise DataError(f"{path} line {n}: field {text_field!r} holds a JSON {type(value).__name__}, "
                            "not text; choose a text field with --text-field")
        if value:
            texts.append(value)
    return texts


def text_batches(texts: list, source: int, done_bytes: int) -> Iterator[Batch]:
    """Texts (str or None) cut into Batches of at most BATCH_CHARS characters / BATCH_DOCS documents."""
    group: list[str] = []
    chars = 0
    for t in texts:
        if not t:
            continue
        group.append(t)
        chars += len(t)
        if chars >= BATCH_CHARS or len(group) >= BATCH_DOCS:
            yield Batch(source, done_bytes, texts=group)
            group, chars = [], 0
    if group:
        yield Batch(source, done_bytes, texts=group)


def text_chunks(path: Path) -> Iterator[tuple[str, int]]:
    """(piece, bytes read so far) of a UTF-8 file, in pieces of about TEXT_CHUNK_CHARS characters cut
    at line ends, so a tokenizer never sees a split word."""
    try:
        with path.open(encoding="utf-8") as f:
            while chunk := f.read(TEXT_CHUNK_CHARS):
                if not chunk.endswith("\n"):
                    chunk += f.readline()
                yield chunk, f.buffer.tell()
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start} of a chunk); "
                        "convert it to UTF-8 first") from None
    except OSError as exc:  # unreadable: permissions, an I/O error
        raise DataError(f"{path} cannot be read ({exc.strerror or exc}); give a readable text file") from None


class Source:
    """One input path; `kind` names its format in meta.json."""

    kind = "text"

    def __init__(self, path: Path):
        self.path = path

    def size(self) -> int:
        return self.path.stat().st_size

    def check(self, text_field: str) -> None:
        """Fail fast, before any tokenizing, on what is wrong at the start of the input."""

    def describe(self) -> dict:
        return {"path": str(self.path.resolve()), "bytes": self.size(), "format": self.kind}

    def records(self, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
        """(where, record) of each record, for `data prepare --format chat|prompt-completion`."""
        raise DataError(f"--format chat and prompt-completion read records (.jsonl, .parquet or a save_to_disk "
                        f"directory), not the text file {self.path}")

    def batches(self, source: int, text_field: str) -> Iterator[Batch]:
        """The whole file as one document, in pieces cut at line ends (no word is split)."""
        previous = None
        for chunk, done in text_chunks(self.path):
            if previous is not None:
                yield previous
            previous = Batch(source, done, texts=[chunk], eos=False)
        last = previous or Batch(source, 0, texts=[""])
        last.eos, last.done_bytes = True, self.size()
        yield last


class JsonLinesSource(Source):
    kind = "jsonl"

    def check(self, text_field: str) -> None:
        with self.path.open("rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if line.lstrip().startswith(b"["):
                    raise DataError(f"{self.path} holds a JSON array; meshrun reads JSON lines (one object per "
                                    f"line): convert it, e.g. jq -c '.[]' {self.path.name} > {self.path.stem}.jsonl")
                parse_json_lines([line], n, str(self.path), text_field)
                return

    def records(self, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
        """("FILE line N", object) of each non-blank line (fields are checked per record by the caller)."""
        with self.path.open("rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{self.path} line {n}"
                yield where, json_object_line(line, where)

    def batches(self, source: int, text_field: str) -> Iterator[Batch]:
        lines: list[bytes] = []
        first, done, size = 1, 0, 0
        with self.path.open("rb") as f:
            for n, line in enumerate(f, 1):
                lines.append(line)
                size += len(line)
                if size >= BATCH_CHARS or len(lines) >= BATCH_DOCS:
                    done += size
                    yield Batch(source, done, lines=lines, first_line=first, path=str(self.path),
                                text_field=text_field)
                    lines, first, size = [], n + 1, 0
        if lines:
            yield Batch(source, done + size, lines=lines, first_line=first, path=str(self.path),
                        text_field=text_field)
