"""Tokenizers: the built-in byte tokenizer and local `tokenizer.json` files (never a hub download)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

from meshrun.errors import DataError

BYTE_SPEC = "byte"


@runtime_checkable
class Tokenizer(Protocol):
    """What meshrun needs from a tokenizer: ids in [0, vocab_size), and a spec to record."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def spec(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then the special tokens <eos>, <bos>, <pad>.

    Needs no file and round-trips any string. `encode` never emits a special token;
    callers add `eos_id` between documents themselves.
    """

    SPECIALS = ("<eos>", "<bos>", "<pad>")

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    @property
    def eos_id(self) -> int:
        return 256

    @property
    def bos_id(self) -> int:
        return 257

    @property
    def pad_id(self) -> int:
        return 258

    @property
    def spec(self) -> str:
        return BYTE_SPEC

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:
        """The same ids as `encode`, as raw bytes: the fast path for large texts."""
        return text.encode("utf-8")

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if 256 <= i < self.vocab_size:
                out.append(self.SPECIALS[i - 256])
            else:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocab ({self.vocab_size})")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


# End-of-text spellings of common tokenizer.json files, most specific first.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class HFTokenizer:
    """A local `tokenizer.json` read with the `tokenizers` package (no network access)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise DataError(
                f"data.tokenizer={str(path)!r} needs the `tokenizers` package, which is not installed; "
                "run: pip install tokenizers (or use data.tokenizer=\"byte\")"
            ) from None
        try:
            self._tok = _Tokenizer.from_file(str(self.path))
        except Exception as exc:  # the Rust side raises a plain Exception
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(f"cannot read tokenizer file {self.path}: {first}") from None
        self._vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._eos_id = next((vocab[name] for name in _EOS_NAMES if name in vocab), None)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def spec(self) -> str:
        return str(self.path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: str | Path | None = BYTE_SPEC) -> ByteTokenizer | HFTokenizer:
    """`"byte"` (or empty) for the built-in byte tokenizer, else the path of a local tokenizer.json."""
    if spec is None or str(spec).strip() in ("", BYTE_SPEC):
        return ByteTokenizer()
    path = Path(str(spec)).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"data.tokenizer={str(spec)!r}: no such file; give the path of a local tokenizer.json "
            "or \"byte\" for the built-in byte tokenizer (meshrun never downloads tokenizers)"
        )
    return HFTokenizer(path)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> dict[str, object]:
    """What meta.json records to recognise the tokenizer later, even if its file has moved."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"spec": BYTE_SPEC, "vocab_size": tokenizer.vocab_size, "sha256": None}
    path = Path(tokenizer.spec)
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return {"spec": tokenizer.spec, "vocab_size": tokenizer.vocab_size, "sha256": digest}
