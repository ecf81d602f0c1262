"""Tokenizers: the built-in byte tokenizer and local Hugging Face tokenizers (never a hub download)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

from meshrun.data.hf_tokenizer import TOKENIZER_JSON, HFTokenizer
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


def load_tokenizer(spec: str | Path | None = BYTE_SPEC) -> ByteTokenizer | HFTokenizer:
    """`"byte"` (or empty) for the built-in byte tokenizer; else a local Hugging Face tokenizer
    directory (tokenizer.json, with tokenizer_config.json / special_tokens_map.json for its
    special tokens) or the path of a lone tokenizer.json."""
    if spec is None or str(spec).strip() in ("", BYTE_SPEC):
        return ByteTokenizer()
    path = Path(str(spec)).expanduser()
    if path.is_dir() and not (path / TOKENIZER_JSON).is_file():
        raise DataError(
            f"data.tokenizer={str(spec)!r} is a directory without {TOKENIZER_JSON}; give a Hugging Face "
            "tokenizer directory saved by a fast tokenizer (tokenizer.save_pretrained(DIR) writes one), "
            "a tokenizer.json, or \"byte\""
        )
    if not path.exists():
        raise DataError(
            f"data.tokenizer={str(spec)!r}: no such file or directory; give a local tokenizer directory, "
            "a tokenizer.json or \"byte\" for the built-in byte tokenizer (meshrun never downloads tokenizers)"
        )
    return HFTokenizer(path)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> dict[str, object]:
    """What meta.json records to recognise the tokenizer later, even if its files have moved:
    the sha256 of its tokenizer.json and the end-of-text id put between documents."""
    eos_id = tokenizer.eos_id
    if isinstance(tokenizer, ByteTokenizer):
        return {"spec": BYTE_SPEC, "vocab_size": tokenizer.vocab_size, "sha256": None, "eos_id": eos_id}
    path = Path(getattr(tokenizer, "json_path", tokenizer.spec))
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return {"spec": tokenizer.spec, "vocab_size": tokenizer.vocab_size, "sha256": digest, "eos_id": eos_id}
