"""A local Hugging Face tokenizer: a directory (tokenizer.json + tokenizer_config.json /
special_tokens_map.json for its special tokens) or a lone tokenizer.json, read with the
`tokenizers` package. Nothing is ever downloaded.

    tok = HFTokenizer("tok/")        # what tokenizer.save_pretrained("tok/") wrote
    tok.eos_id, tok.bos_id, tok.pad_id, tok.unk_id
"""

from __future__ import annotations

import json
from pathlib import Path

from meshrun.errors import DataError
from meshrun.extras import missing_extra_message
from meshrun.runtime.inputs import user_file

TOKENIZER_JSON = "tokenizer.json"
# Where transformers records the special tokens. tokenizer_config.json wins, as in transformers 5
# (which ignores special_tokens_map.json once tokenizer_config.json lists its added tokens);
# special_tokens_map.json fills the keys it lacks (files saved by older transformers).
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
# End-of-text spellings of common tokenizer.json files, most specific first: the eos of a
# tokenizer whose configuration names none (a lone tokenizer.json).
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
_MAX_CONFIG_BYTES = 16 << 20  # a tokenizer config is a few KB; larger is not one


def _token_text(value: object) -> str | None:
    """A special token as written by transformers: "<s>", {"content": "<s>", ...} or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise DataError(f"{path} is {path.stat().st_size:,} bytes, too large for a tokenizer config; "
                        "check the tokenizer directory")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: not valid JSON ({exc}); fix or remove the file") from None
    if not isinstance(raw, dict):
        raise DataError(f"cannot read {path}: a JSON object was expected, found {type(raw).__name__}")
    return raw


def special_tokens(directory: Path) -> dict[str, tuple[str, Path]]:
    """{"eos_token": ("</s>", file it came from), ...} from the directory's config files."""
    found: dict[str, tuple[str, Path]] = {}
    for name in CONFIG_FILES:
        raw = _read_config(directory / name)
        for key in SPECIAL_KEYS:
            text = _token_text(raw.get(key))
            if text is not None and key not in found:
                found[key] = (text, directory / name)
    return found


TOKENIZER_LIMIT = 256 << 20  # the largest tokenizer.json of 2026's open models is ~35 MB


class HFTokenizer:
    """A Hugging Face tokenizer directory, or a lone `tokenizer.json` (then eos is found by name)."""

    def __init__(self, path: str | Path):
        path = Path(path).expanduser().resolve()
        self.path = path
        self.directory = path if path.is_dir() else None
        self.json_path = path / TOKENIZER_JSON if path.is_dir() else path
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise DataError(missing_extra_message("tokenizers", f"data.tokenizer={str(path)!r}")
                            + " (or pip install tokenizers), or use data.tokenizer=\"byte\"") from None
        # a regular file (a FIFO would block the reader for ever), of a size a tokenizer can be
        user_file("data.tokenizer", self.json_path, limit=TOKENIZER_LIMIT,
                  fix="give a tokenizer directory saved by save_pretrained, a tokenizer.json or \"byte\"")
        try:
            self._tok = _Tokenizer.from_file(str(self.json_path))
        except Exception as exc:  # the Rust side raises a plain Exception
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(f"data.tokenizer={str(self.json_path)!r} cannot be read as a tokenizer: {first[:200]}; "
                            "give a tokenizer.json that tokenizers can load (save_pretrained writes one)") from None
        self._vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._special: dict[str, int | None] = dict.fromkeys(SPECIAL_KEYS)
        for key, (text, source) in (special_tokens(self.directory) if self.directory else {}).items():
            if text not in vocab:
                raise DataError(f"{source}: {key} {text!r} is not in {self.json_path.name}'s vocabulary "
                                f"({self._vocab_size} tokens); fix the file or save the tokenizer again")
            self._special[key] = vocab[text]
        if self._special["eos_token"] is None:
            self._special["eos_token"] = next((vocab[n] for n in _EOS_NAMES if n in vocab), None)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int | None:
        """The end-of-text token meshrun puts after each document."""
        return self._special["eos_token"]

    @property
    def bos_id(self) -> int | None:
        return self._special["bos_token"]

    @property
    def pad_id(self) -> int | None:
        return self._special["pad_token"]

    @property
    def unk_id(self) -> int | None:
        return self._special["unk_token"]

    @property
    def spec(self) -> str:
        return str(self.path)

    @property
    def files(self) -> list[Path]:
        """The tokenizer's files on disk (what an export copies next to the model)."""
        extra = [self.path / n for n in CONFIG_FILES] if self.directory else []
        return [self.json_path, *(p for p in extra if p.is_file())]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text in one call (threads of its own unless TOKENIZERS_PARALLELISM=false)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"
