"""Token files: `meshrun data prepare` (meshrun.data.prepare) writes DIR/tokens.bin + DIR/meta.json;
`open_tokens` maps them.

tokens.bin is a flat little-endian array of token ids (uint16 when the vocab fits, else uint32),
one `eos_id` after each document (a text file is one document; a .jsonl/.parquet/datasets
record is one). meta.json says how to read it and how to check it.
`open_tokens` memory-maps the file (torch.from_file, MAP_PRIVATE), so N ranks share the page
cache instead of holding N copies, and nothing is read until it is indexed.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from meshrun.data.sources import text_chunks
from meshrun.data.tokenizer import ByteTokenizer, Tokenizer
from meshrun.errors import DataError
from meshrun.runtime.inputs import read_text

if TYPE_CHECKING:  # torch is imported where tokens are read: `meshrun data prepare` never needs it
    import torch

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
LOSS_MASK_FILE = "loss_mask.bin"  # uint8 per token: 1 = trained as a target (chat / prompt-completion data)
EXAMPLES_FILE = "examples.bin"  # int64 per example: the token offset where it starts
IGNORE_INDEX = -100  # the target of a token whose mask is 0: F.cross_entropy's default ignore_index
FORMAT = "meshrun-tokens"
FORMAT_VERSION = 2  # 2 adds loss_mask and examples; plain text is still written as version 1
TEXT_VERSION = 1
DTYPES = ("uint16", "uint32")  # names of torch dtypes
ITEMSIZE = {"uint16": 2, "uint32": 4}
# Files up to this size get a full sha256 check on open (about 0.3 s); larger ones a sampled one.
FULL_VERIFY_MAX_BYTES = 256 << 20
_SAMPLE_BLOCKS, _SAMPLE_BLOCK_BYTES = 64, 4096

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
    version: int = TEXT_VERSION
    records: str = "text"
    """What was tokenized: "text", "chat" or "prompt-completion" (version 2)."""
    loss_mask: dict | None = None
    """Version 2: `{"file", "sha256", "num_trained", "train_on"}` of loss_mask.bin (uint8, one per token,
    1 = the token is trained as a target); None = every token is trained."""
    examples: dict | None = None
    """Version 2: `{"file", "sha256", "count"}` of examples.bin (int64 start offset of each example)."""
    skipped: dict | None = None
    """Version 2: records left out, by reason (`{"too_long": n, "empty": n, "unknown_role": n, ...}`)."""

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * ITEMSIZE[self.dtype]


def meta_json(meta: TokenMeta) -> str:
    """meta.json's text: version-2 keys only when set, so a text directory's file is as version 1 wrote it."""
    from dataclasses import asdict

    raw = asdict(meta)
    if meta.version < 2:
        for key in ("records", "loss_mask", "examples", "skipped"):
            raw.pop(key)
    return json.dumps(raw, indent=2) + "\n"


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def encode_text(text: str, tokenizer: Tokenizer) -> torch.Tensor:
    """Token ids of `text` as a 1-D int64 tensor (a fast path for the byte tokenizer)."""
    import torch

    if type(tokenizer) is ByteTokenizer:  # not a subclass, which may encode differently
        return torch.frombuffer(bytearray(tokenizer.encode_bytes(text)), dtype=torch.uint8).to(torch.int64)
    return torch.tensor(tokenizer.encode(text), dtype=torch.int64)


def encode_file(path: Path, tokenizer: Tokenizer) -> torch.Tensor:
    """A text file's ids (int64), without an end-of-text token."""
    import torch

    parts = [encode_text(chunk, tokenizer) for chunk, _ in text_chunks(path)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


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


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 62


def _sha(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def read_meta(path: str | Path) -> TokenMeta:
    """Parse and check DIR/meta.json; any problem is a one-line DataError."""
    path = Path(path).expanduser()
    _check_dir(path)
    meta_path = path / META_FILE
    try:
        raw = json.loads(read_text("data.path", meta_path, fix=REPREPARE_HINT))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _corrupt(meta_path, f"not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _corrupt(meta_path, f"not a meshrun token meta file (format should be {FORMAT!r})")
    if not _count(raw.get("version")):
        raise _corrupt(meta_path, f"version {raw.get('version')!r} is not a format version")
    if raw["version"] > FORMAT_VERSION:
        raise DataError(f"{meta_path} has format version {raw.get('version')!r}, but this meshrun reads "
                        f"up to {FORMAT_VERSION}; upgrade meshrun or {REPREPARE_HINT}")
    known = set(TokenMeta.__dataclass_fields__)
    try:
        meta = TokenMeta(**{k: v for k, v in raw.items() if k in known})
    except TypeError as exc:
        raise _corrupt(meta_path, str(exc).replace("TokenMeta.__init__() ", "")) from None
    checks = [
        (isinstance(meta.dtype, str) and meta.dtype in DTYPES, f"dtype {meta.dtype!r} is not one of {sorted(DTYPES)}"),
        (_count(meta.num_tokens), f"num_tokens {meta.num_tokens!r}"),
        (_count(meta.vocab_size), f"vocab_size {meta.vocab_size!r}"),
        (_sha(meta.sha256) and _sha(meta.sample_sha256), "its checksums are not sha256 digests"),
        (meta.byte_order == "little", f"byte_order {meta.byte_order!r}"),
        (isinstance(meta.tokenizer, dict), f"tokenizer {meta.tokenizer!r} is not a table"),
        (isinstance(meta.sources, list) and all(isinstance(x, dict) for x in meta.sources),
         f"sources {meta.sources!r} is not a list of tables"),
        (meta.loss_mask is None or (isinstance(meta.loss_mask, dict) and meta.loss_mask.get("file") == LOSS_MASK_FILE
                                    and _sha(meta.loss_mask.get("sha256"))),
         f"loss_mask {meta.loss_mask!r} is not a table naming {LOSS_MASK_FILE} and its sha256"),
        (meta.val_fraction is None or (type(meta.val_fraction) in (int, float) and 0 <= meta.val_fraction < 1),
         f"val_fraction {meta.val_fraction!r} is not in [0, 1)"),
    ]
    for ok, why in checks:
        if not ok:
            raise _corrupt(meta_path, why)
    return meta


def open_loss_mask(path: str | Path, meta: TokenMeta, *, verify: str = "auto") -> torch.Tensor | None:
    """Memory-map DIR/loss_mask.bin (uint8, one per token) after checking its size and sha256;
    None for a directory without one (every token trained)."""
    if meta.loss_mask is None:
        return None
    mask_path = Path(path).expanduser() / LOSS_MASK_FILE
    if not mask_path.is_file():
        raise DataError(f"{mask_path} is missing, but {META_FILE} records a loss mask; {REPREPARE_HINT}")
    found = mask_path.stat().st_size
    if found != meta.num_tokens:
        raise _corrupt(mask_path, f"expected {meta.num_tokens} bytes (one per token), found {found}")
    if verify in ("auto", "full") and (verify == "full" or found <= FULL_VERIFY_MAX_BYTES):
        if _full_sha256(mask_path) != meta.loss_mask["sha256"]:
            raise _corrupt(mask_path, "sha256 does not match meta.json (the file changed after prepare)")
    import torch

    return torch.from_file(str(mask_path), shared=False, size=meta.num_tokens, dtype=torch.uint8)


def open_examples(path: str | Path, meta: TokenMeta) -> torch.Tensor | None:
    """DIR/examples.bin as int64 offsets, one per example plus the end (num_tokens), after checking
    its size, its sha256 and that the offsets rise from 0; None for a directory without one (text)."""
    if meta.examples is None:
        return None
    ex_path = Path(path).expanduser() / EXAMPLES_FILE
    if not ex_path.is_file():
        raise DataError(f"{ex_path} is missing, but {META_FILE} records examples; {REPREPARE_HINT}")
    count = meta.examples.get("count")
    found = ex_path.stat().st_size
    if not _count(count) or found != count * 8:
        raise _corrupt(ex_path, f"expected {count!r} int64 offsets, found {found} bytes")
    if _full_sha256(ex_path) != meta.examples.get("sha256"):
        raise _corrupt(ex_path, "sha256 does not match meta.json (the file changed after prepare)")
    import torch

    starts = torch.frombuffer(bytearray(ex_path.read_bytes()), dtype=torch.int64)
    bounds = torch.cat([starts, torch.tensor([meta.num_tokens])])
    if int(starts[0]) != 0 or bool((bounds[1:] < bounds[:-1]).any()):
        raise _corrupt(ex_path, "its offsets do not rise from 0 to the token count")
    return bounds


def sample_sha256(path: Path) -> str:
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
    if verify == "sample" and sample_sha256(bin_path) != meta.sample_sha256:
        raise _corrupt(bin_path, "sampled sha256 does not match meta.json (the file changed after prepare)")
    if vocab_size is not None and meta.vocab_size > vocab_size:
        raise DataError(f"token directory {path} was prepared with vocab_size {meta.vocab_size} "
                        f"({meta.tokenizer.get('spec')}), larger than the model's vocab_size {vocab_size}; "
                        "raise the model's vocab_size or prepare the data with a smaller tokenizer")
    import torch

    tokens = torch.from_file(str(bin_path), shared=False, size=meta.num_tokens, dtype=getattr(torch, meta.dtype))
    return tokens, meta
