"""Token files: `meshrun data prepare` writes DIR/tokens.bin + DIR/meta.json; `open_tokens` maps them.

    meshrun data prepare book.txt notes.txt --out data/books      # byte tokenizer
    meshrun data prepare corpus/*.txt --out data/c --tokenizer tok/tokenizer.json

tokens.bin is a flat little-endian array of token ids (uint16 when the vocab fits, else uint32),
one `eos_id` after each source file. meta.json says how to read it and how to check it.
`open_tokens` memory-maps the file (torch.from_file, MAP_PRIVATE), so N ranks share the page
cache instead of holding N copies, and nothing is read until it is indexed.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from meshrun.data.tokenizer import ByteTokenizer, Tokenizer, tokenizer_fingerprint
from meshrun.errors import DataError

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
FORMAT = "meshrun-tokens"
FORMAT_VERSION = 1
DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
ITEMSIZE = {"uint16": 2, "uint32": 4}
# Files up to this size get a full sha256 check on open (about 0.3 s); larger ones a sampled one.
FULL_VERIFY_MAX_BYTES = 256 << 20
_SAMPLE_BLOCKS, _SAMPLE_BLOCK_BYTES = 64, 4096
_CHUNK_CHARS = 8 << 20  # text is encoded in pieces of about this many characters, cut at line ends

PREPARE_HINT = "run: meshrun data prepare FILE --out {dir}"
REPREPARE_HINT = "re-run meshrun data prepare"


@dataclass(frozen=True)
class TokenMeta:
    """The contents of meta.json."""

    dtype: str
    num_tokens: int
    vocab_size: int
    tokenizer: dict
    """`{"spec": "byte" | path, "vocab_size": V, "sha256": hash of tokenizer.json or None}`."""
    sha256: str
    """sha256 of the whole tokens.bin."""
    sample_sha256: str
    """sha256 of the file size and 64 evenly spaced 4 KiB blocks: the check for large files."""
    sources: list = field(default_factory=list)
    """`[{"path", "bytes", "num_tokens"}]`, in file order."""
    val_fraction: float | None = None
    """Held-out tail chosen at prepare time (`--val-fraction`); None lets data.val_fraction decide."""
    byte_order: str = "little"
    format: str = FORMAT
    version: int = FORMAT_VERSION

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * ITEMSIZE[self.dtype]


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # A memcpy of the tensor's buffer: torch has no tobytes(), and numpy is not a dependency.
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def _text_chunks(path: Path):
    """The file's text in pieces cut at line ends, so a tokenizer never sees a split word."""
    try:
        with path.open(encoding="utf-8") as f:
            while True:
                chunk = f.read(_CHUNK_CHARS)
                if not chunk:
                    return
                if not chunk.endswith("\n"):
                    chunk += f.readline()
                yield chunk
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start} of a chunk); "
                        "convert it to UTF-8 first") from None


def encode_text(text: str, tokenizer: Tokenizer) -> torch.Tensor:
    """Token ids of `text` as a 1-D int64 tensor (a fast path for the byte tokenizer)."""
    if type(tokenizer) is ByteTokenizer:  # not a subclass, which may encode differently
        return torch.frombuffer(bytearray(tokenizer.encode_bytes(text)), dtype=torch.uint8).to(torch.int64)
    return torch.tensor(tokenizer.encode(text), dtype=torch.int64)


def encode_file(path: Path, tokenizer: Tokenizer) -> torch.Tensor:
    """A text file's ids (int64), without an end-of-text token."""
    parts = [encode_text(chunk, tokenizer) for chunk in _text_chunks(path)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def prepare_tokens(sources: list[str | Path], out_dir: str | Path, tokenizer: Tokenizer, *,
                   val_fraction: float | None = None) -> TokenMeta:
    """Tokenize `sources` into out_dir/tokens.bin and write out_dir/meta.json (last, atomically)."""
    paths = [Path(s).expanduser() for s in sources]
    if not paths:
        raise DataError("no input files; usage: meshrun data prepare FILE... --out DIR")
    for p in paths:
        if not p.is_file():
            raise DataError(f"input file {p} does not exist" if not p.exists() else f"input {p} is not a file")
    if val_fraction is not None and not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if sys.byteorder == "big":
        raise DataError("meshrun token files are little-endian, and this machine is big-endian")
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    (out / META_FILE).unlink(missing_ok=True)  # no meta = not a usable directory, until we finish
    digest, sources_meta, num_tokens = hashlib.sha256(), [], 0
    tmp = out / (TOKENS_FILE + ".tmp")
    with tmp.open("wb") as f:
        for p in paths:
            ids = encode_file(p, tokenizer)
            if tokenizer.eos_id is not None:
                ids = torch.cat([ids, torch.tensor([tokenizer.eos_id])])
            data = _tensor_bytes(ids.to(DTYPES[dtype]))
            f.write(data)
            digest.update(data)
            num_tokens += ids.numel()
            sources_meta.append({"path": str(p.resolve()), "bytes": p.stat().st_size,
                                 "num_tokens": int(ids.numel())})
    if num_tokens == 0:
        tmp.unlink()
        raise DataError(f"the input files {[str(p) for p in paths]} hold no text")
    os.replace(tmp, out / TOKENS_FILE)
    meta = TokenMeta(dtype=dtype, num_tokens=num_tokens, vocab_size=tokenizer.vocab_size,
                     tokenizer=tokenizer_fingerprint(tokenizer), sha256=digest.hexdigest(),
                     sample_sha256=_sample_sha256(out / TOKENS_FILE), sources=sources_meta,
                     val_fraction=val_fraction)
    tmp_meta = out / (META_FILE + ".tmp")
    tmp_meta.write_text(json.dumps(asdict(meta), indent=2) + "\n")
    os.replace(tmp_meta, out / META_FILE)
    return meta


def _corrupt(path: Path, why: str) -> DataError:
    return DataError(f"corrupt token file {path}: {why}; {REPREPARE_HINT}")


def _check_dir(path: Path) -> None:
    if not path.exists():
        raise DataError(f"token directory {path} does not exist; {PREPARE_HINT.format(dir=path)}")
    if not path.is_dir():
        raise DataError(f"{path} is not a token directory; {PREPARE_HINT.format(dir=path)}")
    for name in (META_FILE, TOKENS_FILE):
        if not (path / name).is_file():
            raise DataError(f"{path / name} is missing, so {path} is not a prepared token directory; "
                            f"{PREPARE_HINT.format(dir=path)}")


def read_meta(path: str | Path) -> TokenMeta:
    """Parse and check DIR/meta.json; any problem is a one-line DataError."""
    path = Path(path).expanduser()
    _check_dir(path)
    meta_path = path / META_FILE
    try:
        raw = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _corrupt(meta_path, f"not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _corrupt(meta_path, f"not a meshrun token meta file (format should be {FORMAT!r})")
    if not isinstance(raw.get("version"), int) or raw["version"] > FORMAT_VERSION:
        raise DataError(f"{meta_path} has format version {raw.get('version')!r}, but this meshrun reads "
                        f"up to {FORMAT_VERSION}; upgrade meshrun or {REPREPARE_HINT}")
    known = set(TokenMeta.__dataclass_fields__)
    try:
        meta = TokenMeta(**{k: v for k, v in raw.items() if k in known})
    except TypeError as exc:
        raise _corrupt(meta_path, str(exc).replace("TokenMeta.__init__() ", "")) from None
    checks = [
        (meta.dtype in DTYPES, f"dtype {meta.dtype!r} is not one of {sorted(DTYPES)}"),
        (isinstance(meta.num_tokens, int) and meta.num_tokens > 0, f"num_tokens {meta.num_tokens!r}"),
        (isinstance(meta.vocab_size, int) and meta.vocab_size > 0, f"vocab_size {meta.vocab_size!r}"),
        (isinstance(meta.sha256, str) and isinstance(meta.sample_sha256, str), "missing checksums"),
        (meta.byte_order == "little", f"byte_order {meta.byte_order!r}"),
    ]
    for ok, why in checks:
        if not ok:
            raise _corrupt(meta_path, why)
    return meta


def _sample_sha256(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        for i in range(_SAMPLE_BLOCKS):
            f.seek(max(0, size - _SAMPLE_BLOCK_BYTES) * i // (_SAMPLE_BLOCKS - 1))
            h.update(f.read(_SAMPLE_BLOCK_BYTES))
    return h.hexdigest()


def _full_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def open_tokens(path: str | Path, *, vocab_size: int | None = None, verify: str = "auto") -> torch.Tensor:
    """Memory-map DIR/tokens.bin as a 1-D uint16/uint32 tensor (copy-on-write), after checking it.

    vocab_size: the model's; a token file with a larger vocab is rejected.
    verify: "full" (sha256 of the whole file), "sample" (64 blocks), "none" (size only), or
    "auto" = full up to 256 MiB, else sample.
    """
    return open_token_dir(path, vocab_size=vocab_size, verify=verify)[0]


def open_token_dir(path: str | Path, *, vocab_size: int | None = None,
                   verify: str = "auto") -> tuple[torch.Tensor, TokenMeta]:
    """`open_tokens`, also returning the parsed meta.json."""
    if verify not in ("auto", "full", "sample", "none"):
        raise ValueError(f"verify must be auto, full, sample or none, got {verify!r}")
    path = Path(path).expanduser()
    meta = read_meta(path)
    bin_path = path / TOKENS_FILE
    found = bin_path.stat().st_size
    if found != meta.num_bytes:
        raise _corrupt(bin_path, f"expected {meta.num_bytes} bytes ({meta.num_tokens} x {meta.dtype}), "
                                 f"found {found}")
    if verify == "auto":
        verify = "full" if found <= FULL_VERIFY_MAX_BYTES else "sample"
    if verify == "full" and _full_sha256(bin_path) != meta.sha256:
        raise _corrupt(bin_path, "sha256 does not match meta.json (the file changed after prepare)")
    if verify == "sample" and _sample_sha256(bin_path) != meta.sample_sha256:
        raise _corrupt(bin_path, "sampled sha256 does not match meta.json (the file changed after prepare)")
    if vocab_size is not None and meta.vocab_size > vocab_size:
        raise DataError(f"token directory {path} was prepared with vocab_size {meta.vocab_size} "
                        f"({meta.tokenizer.get('spec')}), larger than the model's vocab_size {vocab_size}; "
                        "raise the model's vocab_size or prepare the data with a smaller tokenizer")
    tokens = torch.from_file(str(bin_path), shared=False, size=meta.num_tokens, dtype=DTYPES[meta.dtype])
    return tokens, meta
