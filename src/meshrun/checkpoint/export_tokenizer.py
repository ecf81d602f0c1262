"""Tokenizer files for an exported Hugging Face directory, and the special-token ids for its config.

- `data.tokenizer = "byte"`: a tokenizer.json that the `tokenizers` package (and transformers'
  AutoTokenizer) reads as exactly meshrun's ByteTokenizer: UTF-8 bytes as ids 0-255, then <eos>,
  <bos>, <pad>. Written only when `tokenizers` is installed.
- a tokenizer.json file, or a Hugging Face tokenizer directory: its files are copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from meshrun.data.tokenizer import BYTE_SPEC, ByteTokenizer

# What a Hugging Face tokenizer directory may hold; each one that exists is copied.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def tokenizer_spec(run_config: dict) -> str:
    return str(run_config.get("data", {}).get("tokenizer", BYTE_SPEC) or BYTE_SPEC)


def token_ids(run_config: dict) -> dict:
    """{"bos": id, "eos": id, "pad": id} as far as the run's tokenizer names them (config.json's *_token_id)."""
    spec = tokenizer_spec(run_config)
    if spec.strip() == BYTE_SPEC:
        tok = ByteTokenizer()
        return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    from meshrun.data.tokenizer import load_tokenizer
    from meshrun.errors import MeshrunError

    try:
        eos = load_tokenizer(spec).eos_id
    except MeshrunError:  # the tokenizer file has moved: the model is still worth exporting
        return {}
    return {"eos": eos} if eos is not None else {}


def write_tokenizer_files(run_config: dict, out: Path, max_len: int | None) -> list[str]:
    """Write or copy the run's tokenizer into `out`; the names written ([] when none is known)."""
    spec = tokenizer_spec(run_config)
    if spec.strip() == BYTE_SPEC:
        return _write_byte_tokenizer(out, max_len)
    path = Path(spec).expanduser()
    if path.is_file():
        shutil.copyfile(path, out / "tokenizer.json")
        return ["tokenizer.json"]
    written = []
    if path.is_dir():
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                shutil.copyfile(path / name, out / name)
                written.append(name)
    return written


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the one `tokenizers`' ByteLevel uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _write_byte_tokenizer(out: Path, max_len: int | None) -> list[str]:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return []
    table = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(ByteTokenizer.SPECIALS))  # ids 256, 257, 258, as ByteTokenizer's
    tok.save(str(out / "tokenizer.json"))
    eos, bos, pad = ByteTokenizer.SPECIALS
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos,
              "pad_token": pad, "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    if max_len:
        config["model_max_length"] = max_len
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]
