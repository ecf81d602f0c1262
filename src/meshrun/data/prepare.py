"""`meshrun data prepare`'s work: read each input, tokenize on `workers` cores, write a token directory.

    meta = prepare_tokens(["a.jsonl", "b.parquet", "hf_dir/"], "data/t", load_tokenizer("tok/"),
                          text_field="text", workers=4, progress=PrepareProgress(workers=4))

The output is the format of meshrun.data.tokens (tokens.bin + meta.json), the same bytes for any
number of workers. Inputs stream: a batch of documents at a time, never a whole file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

from meshrun.data.arrow_sources import ArrowDirSource, ParquetSource
from meshrun.data.encode import encode_batches
from meshrun.data.prepare_progress import PrepareProgress
from meshrun.data.sources import JSONL_SUFFIXES, JsonLinesSource, Source
from meshrun.data.tokenizer import Tokenizer, tokenizer_fingerprint
from meshrun.data.tokens import (
    EXAMPLES_FILE,
    LOSS_MASK_FILE,
    META_FILE,
    TOKENS_FILE,
    TokenMeta,
    dtype_for_vocab,
    meta_json,
    sample_sha256,
)
from meshrun.errors import DataError

DEFAULT_TEXT_FIELD = "text"


def open_source(path: str | Path, *, split: str | None = None) -> Source:
    """The reader for `path`: by suffix (.jsonl/.json/.ndjson, .parquet, anything else is text),
    or for a directory, a `datasets` save_to_disk directory (`split` of a DatasetDict)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"input file {p} does not exist")
    if p.is_dir():
        return ArrowDirSource(p, split)
    if not p.is_file():
        raise DataError(f"input {p} is not a file")
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return JsonLinesSource(p)
    if suffix == ".parquet":
        return ParquetSource(p)
    return Source(p)


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a directory")
    if sys.byteorder == "big":
        raise DataError("meshrun token files are little-endian, and this machine is big-endian")


def abandon_tokens(tmp: Path, created: Path | None) -> None:
    """A failed prepare: its partial tokens go, and so does the --out directory it created (if empty)."""
    tmp.unlink(missing_ok=True)
    if created is not None:
        with contextlib.suppress(OSError):
            created.rmdir()


def prepare_tokens(sources: list[str | Path], out_dir: str | Path, tokenizer: Tokenizer, *,
                   val_fraction: float | None = None, text_field: str = DEFAULT_TEXT_FIELD,
                   split: str | None = None, workers: int = 1,
                   progress: PrepareProgress | None = None) -> TokenMeta:
    """Tokenize `sources` into out_dir/tokens.bin and write out_dir/meta.json (last, atomically).

    text_field: the field of .jsonl/.parquet/datasets records that holds the text.
    split: a DatasetDict directory's split (default "train").
    workers: processes that tokenize (1 = this one); the output does not depend on it.
    progress: shown after each batch and closed at the end; None = silent.
    """
    if not sources:
        raise DataError("no input files; usage: meshrun data prepare FILE... --out DIR")
    inputs = [open_source(s, split=split) for s in sources]
    for src in inputs:  # every input's field checked before the first token: a typo costs no time
        src.check(text_field)
    if val_fraction is not None and not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    out = Path(out_dir).expanduser()
    check_out_dir(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    sizes = [src.size() for src in inputs]
    if progress is not None:
        progress.start(sum(sizes))
    counts = [[0, 0] for _ in inputs]  # tokens, documents per input
    digest, num_tokens, num_docs = hashlib.sha256(), 0, 0
    batches = (b for i, src in enumerate(inputs) for b in src.batches(i, text_field))
    tmp = out / (TOKENS_FILE + ".tmp")
    try:
        with tmp.open("wb") as f:
            for done in encode_batches(batches, tokenizer, dtype, workers=workers):
                f.write(done.data)
                digest.update(done.data)
                counts[done.source][0] += done.num_tokens
                counts[done.source][1] += done.num_documents
                num_tokens += done.num_tokens
                num_docs += done.num_documents
                if progress is not None:
                    progress.update(sum(sizes[:done.source]) + done.done_bytes, num_docs, num_tokens)
    except BaseException:
        abandon_tokens(tmp, out if created else None)  # a directory prepared before stays as it was
        if progress is not None:
            progress.close(summary=False)
        raise
    if progress is not None:
        progress.close()
    if num_tokens == 0:
        abandon_tokens(tmp, out if created else None)
        records = "" if all(type(s) is Source for s in inputs) else f" (records' field {text_field!r})"
        raise DataError(f"the inputs {[str(s) for s in sources]} hold no text{records}")
    (out / META_FILE).unlink(missing_ok=True)  # no meta = not a usable directory, until the new one is written
    os.replace(tmp, out / TOKENS_FILE)
    for stale in (LOSS_MASK_FILE, EXAMPLES_FILE):  # a chat prepare's, before: text data trains every token
        (out / stale).unlink(missing_ok=True)
    described = []
    for src, (tokens, docs) in zip(inputs, counts, strict=True):
        info = {**src.describe(), "num_tokens": tokens, "num_documents": docs}
        described.append(info if type(src) is Source else {**info, "text_field": text_field})
    meta = TokenMeta(dtype=dtype, num_tokens=num_tokens, vocab_size=tokenizer.vocab_size,
                     tokenizer=tokenizer_fingerprint(tokenizer), sha256=digest.hexdigest(),
                     sample_sha256=sample_sha256(out / TOKENS_FILE), sources=described,
                     val_fraction=val_fraction)
    tmp_meta = out / (META_FILE + ".tmp")
    tmp_meta.write_text(meta_json(meta))
    os.replace(tmp_meta, out / META_FILE)
    return meta
