"""A hostile-file corpus, generated from a seed: every file is refused in one line before anything starts.

A tiny Hugging Face model is saved once; each case copies it and breaks one file the way a
damaged download, a mistaken path or an attacker would: config.json and tokenizer.json with
wrong types, missing keys, garbage, FIFOs, device symlinks and huge sizes; safetensors files
truncated, with garbage or huge header lengths, overlapping offsets, integer dtypes, other
shapes, tensors left out; a token directory's meta.json (FIFOs, devices, wrong types and
ranges, missing keys) and tokens.bin (truncated, FIFO, device, huge). Each case goes through `meshrun train`'s checks (train/preflight.py),
in this process: the outcome must be a MeshrunError, exit code 2, one line naming the key, and
nothing created. A traceback, a hang (pytest-timeout) or an acceptance fails the case.
MESHRUN_HOSTILE_CASES sets the count (CI: 120) and MESHRUN_HOSTILE_SEED the seed; `pytest -s` prints
the figures by class.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import struct
from pathlib import Path

import pytest
from conftest import env_int, save_hf_tokenizer, save_tiny_hf

from meshrun.config import load_config
from meshrun.errors import MeshrunError
from meshrun.train.preflight import check_before_torch, check_with_torch

CASES = env_int("MESHRUN_HOSTILE_CASES", 120)
SEED = env_int("MESHRUN_HOSTILE_SEED", 2026)
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
SHAPE_KEYS = (*REQUIRED, "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
BAD_VALUES = {"int": ("32", True, -3, 0, 1.5, {"a": 1}, [32], "NaN"), "float": ("1e-6", True, -1.0, {"a": 1}, [1e-6]),
              "bool": ("yes", 1, "true", [True])}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    save_tiny_hf(root / "model")
    save_hf_tokenizer(root / "tokenizer", ["hello world, a tiny corpus for a tiny tokenizer"] * 20)
    from meshrun.data.prepare import prepare_tokens
    from meshrun.data.tokenizer import load_tokenizer

    (root / "corpus.txt").write_text("hello world, a tiny corpus for a tiny tokenizer\n" * 400)
    prepare_tokens([root / "corpus.txt"], root / "data", load_tokenizer(root / "tokenizer"))
    (root / "corpus.txt").unlink()
    return root


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _tensors(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


def _break(case: Path, rng: random.Random) -> tuple[str, str]:
    """Break one file of the copy at `case`; (class, key the refusal must name)."""
    config, weights = case / "model" / "config.json", case / "model" / "model.safetensors"
    tokenizer = case / "tokenizer" / "tokenizer.json"
    target = rng.choice(["config", "weights", "weights", "tokenizer", "meta", "tokens"])
    if target == "tokenizer":
        key, path = "data.tokenizer", tokenizer
    elif target in ("meta", "tokens"):
        key, path = "data.path", case / "data" / ("meta.json" if target == "meta" else "tokens.bin")
    else:
        key, path = "model.hf", config if target == "config" else weights
    kind = rng.choice(["fifo", "device", "huge", "garbage", "content", "content", "content"])
    if target == "tokens" and kind in ("garbage", "content"):
        kind = "truncated"
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[:rng.randrange(0, path.stat().st_size - 1)])
        return "tokens: truncated", key
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "huge":
        with open(path, "wb") as fp:  # sparse: a size, not data on disk
            fp.truncate(rng.randrange(300 << 20, 1 << 40))
    elif kind == "garbage":
        path.write_bytes(rng.randbytes(rng.randrange(0, 4096)))
    else:
        return _break_content(target, case, rng), key
    return f"{target}: {kind}", key


def _break_content(target: str, case: Path, rng: random.Random) -> str:
    original = case.parent / "original"
    if target == "meta":
        meta = json.loads((original / "data" / "meta.json").read_text())
        name = rng.choice(["format", "version", "dtype", "num_tokens", "vocab_size", "sha256", "sample_sha256",
                           "byte_order", "tokenizer", "sources", "val_fraction"])
        if rng.random() < 0.3 and name not in ("byte_order", "sources", "val_fraction"):  # those have defaults
            del meta[name]
            how = f"no {name}"
        else:
            meta[name] = rng.choice(["x", -1, 2**70, 1.5, [1], {"a": 1}, True] + ([] if name == "val_fraction" else [None])
                                    + ([] if name in ("version", "val_fraction") else [0]))
            how = f"{name}={meta[name]!r}"
        (case / "data" / "meta.json").write_text(json.dumps(meta))
        return f"meta: {how}"
    if target == "config":
        config = json.loads((original / "model" / "config.json").read_text())
        name = rng.choice(SHAPE_KEYS)
        if name in REQUIRED and rng.random() < 0.3:
            del config[name]
            how = f"no {name}"
        else:
            kind = "bool" if name == "tie_word_embeddings" else "float" if name == "rms_norm_eps" else "int"
            config[name] = rng.choice(BAD_VALUES[kind])
            how = f"{name}={config[name]!r}"
        (case / "model" / "config.json").write_text(json.dumps(config))
        return f"config: {how}"
    if target == "tokenizer":
        text = (original / "tokenizer" / "tokenizer.json").read_text()
        cut = rng.randrange(1, len(text) - 1)
        (case / "tokenizer" / "tokenizer.json").write_text(text[:cut])
        return "tokenizer: truncated"
    weights = case / "model" / "model.safetensors"
    raw = (original / "model" / "model.safetensors").read_bytes()
    header, data = _header(original / "model" / "model.safetensors")
    names = _tensors(header)
    how = rng.choice(["truncated", "header length", "overlap", "dtype", "shape", "missing", "past the end"])
    if how == "truncated":
        weights.write_bytes(raw[:rng.randrange(0, len(raw) - 1)])
        return "weights: truncated"
    if how == "header length":
        weights.write_bytes(struct.pack("<Q", rng.randrange(len(raw), 1 << 63)) + raw[8:])
        return "weights: header length"
    a, b = rng.sample(names, 2)
    if how == "overlap":
        header[b]["data_offsets"] = list(header[a]["data_offsets"])
    elif how == "dtype":
        header[a]["dtype"] = rng.choice(["I32", "I16", "U8", "BOOL", "I64"])
        size = {"I32": 4, "I16": 2, "U8": 1, "BOOL": 1, "I64": 8}[header[a]["dtype"]]
        begin, end = header[a]["data_offsets"]
        count = (end - begin) // size
        header[a]["shape"] = [count] if count * size == end - begin else header[a]["shape"]
    elif how == "shape":  # the same number of elements, so the header stays valid: only the model objects
        shape = header[a]["shape"]
        if len(shape) > 1:
            header[a]["shape"] = list(reversed(shape)) if shape[0] != shape[-1] else [*shape, 1]
        else:
            header[a]["shape"] = [shape[0] // 2, 2] if shape[0] % 2 == 0 else [1, shape[0]]
    elif how == "missing":
        begin, end = header[a]["data_offsets"]
        del header[a]
        for name in _tensors(header):  # keep the buffer contiguous without it
            lo, hi = header[name]["data_offsets"]
            if lo >= end:
                header[name]["data_offsets"] = [lo - (end - begin), hi - (end - begin)]
        data = data[:begin] + data[end:]
    else:  # "past the end"
        header[a]["data_offsets"] = [header[a]["data_offsets"][0], len(data) + rng.randrange(1, 1 << 20)]
    _write_header(weights, header, data)
    return f"weights: {how}"


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _check(case: Path) -> None:
    cfg = load_config(None, [f"model.hf={case / 'model'}", f"data.tokenizer={case / 'tokenizer'}",
                             f"data.path={case / 'data'}",
                             "data.seq_len=32", f"train.run_dir={case / 'runs'}"])
    check_before_torch(cfg, nproc_per_node="2")
    check_with_torch(cfg, nproc_per_node="2")


@pytest.mark.timeout(240)  # a FIFO that blocks a reader would hang here: the bound fails it
def test_hostile_files_are_refused_in_one_line_before_anything_starts(base, tmp_path):
    original = tmp_path / "original"
    shutil.copytree(base, original, symlinks=True)
    _check(original)  # the unbroken copy passes: a refusal below is the broken file's
    rng = random.Random(SEED)
    outcomes: collections.Counter[str] = collections.Counter()
    for i in range(CASES):
        case = tmp_path / f"case{i}"
        shutil.copytree(original, case, symlinks=True)
        what, key = _break(case, rng)
        before = _tree(case)
        try:
            _check(case)
        except MeshrunError as exc:
            message = str(exc)
            assert "\n" not in message and key in message, f"{what}: {message!r}"
            assert exc.exit_code == 2, f"{what}: exit {exc.exit_code}: {message}"
        except Exception as exc:  # a traceback the user would have seen
            raise AssertionError(f"case {i} ({what}): {type(exc).__name__}: {exc}") from exc
        else:
            pytest.fail(f"case {i} ({what}) was accepted")
        assert _tree(case) == before, f"{what}: files were created: {_tree(case) - before}"
        outcomes[what.split(":")[0] + ":" + what.split(":")[1].split("=")[0]] += 1
        shutil.rmtree(case, ignore_errors=True)
    print(f"\nhostile files: {CASES} cases, all refused in one line, exit 2, nothing created: "
          + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))


def test_a_latest_pointer_that_is_not_a_small_text_file_reads_as_none(tmp_path):
    """`latest` as a FIFO (would block), a device (never ends), binary or oversized: no pointer."""
    from meshrun.checkpoint.manifest import LATEST, read_latest, write_latest

    write_latest(tmp_path, "step-00000005")
    assert read_latest(tmp_path) == "step-00000005"  # the real thing still reads
    for make in (lambda p: os.mkfifo(p), lambda p: p.symlink_to("/dev/zero"),
                 lambda p: p.write_bytes(b"\xff\xfe step"), lambda p: p.write_text("x" * 5000)):
        (tmp_path / LATEST).unlink()
        make(tmp_path / LATEST)
        assert read_latest(tmp_path) is None


def test_a_manifest_that_is_not_a_small_regular_file_is_damage_not_a_hang(tmp_path):
    """A checkpoint's manifest.json as a FIFO (a reader would wait for ever), a device or oversized."""
    from meshrun.checkpoint.manifest import MANIFEST, CheckpointError, read_manifest
    from meshrun.checkpoint.schema import MAX_MANIFEST_BYTES

    for make in (lambda p: os.mkfifo(p), lambda p: p.symlink_to("/dev/zero"),
                 lambda p: p.write_bytes(b"{" * (MAX_MANIFEST_BYTES + 1))):
        (tmp_path / MANIFEST).unlink(missing_ok=True)
        make(tmp_path / MANIFEST)
        with pytest.raises(CheckpointError, match="manifest.json is damaged"):
            read_manifest(tmp_path)


def test_a_prompt_that_is_not_utf8_is_one_line(capsys):
    from meshrun.cli import main

    assert main(["generate", "runs/none", "--prompt", "caf\udce9"]) == 2  # bytes b"caf\xe9" from a latin-1 terminal
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--prompt is not UTF-8 text" in err, err
