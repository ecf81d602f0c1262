"""One in-memory snapshot file: raw tensor bytes after a JSON header, never a pickle.

    write_snapshot(path, step=12, tree={"model": {...}, "rng": {...}}, meta={...})
    step, tree, meta = read_snapshot(path)   # None for a torn, truncated or foreign file

Layout: the 8 bytes MAGIC, the header's length (u64) and CRC-32 (u32), little-endian, the UTF-8
JSON header, then every tensor's bytes back to back. The header holds the tree of plain values
(dicts, lists, tuples, numbers, strings) with each tensor replaced by `{"__t__": i}`, and each
tensor's dtype, shape, offset and size. A reader checks the header's CRC and the file's size
against it, and every tensor's extent, before it builds a single tensor, so a damaged file is
"no snapshot", not a crash (data from disk is data). The tensor bytes carry no checksum: a CRC of them
cost as much as the copy itself, and the files live in the launcher's private (0700) tmpfs
directory, written only by this run's workers. A write goes to a temporary name and is renamed
into place: a kill in the middle of it leaves the previous snapshot whole.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

MAGIC = b"MRSNAP01"
VERSION = 1
SUFFIX = ".snap"
_PREFIX = len(MAGIC) + 12  # MAGIC, u64 header length, u32 header CRC-32
MAX_HEADER = 64 << 20  # a header larger than this is damage, not a snapshot
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def snapshot_name(step: int) -> str:
    return f"step-{step:08d}{SUFFIX}"


def snapshot_step(path: Path) -> int | None:
    """The step a finished snapshot file's name says; None for temporary or foreign names."""
    name = path.name
    if not (name.startswith("step-") and name.endswith(SUFFIX)):
        return None
    digits = name[len("step-"):-len(SUFFIX)]
    return int(digits) if digits.isdigit() and len(digits) == 8 else None


_PLAIN = frozenset({type(None), bool, int, float, str})


def encode_tree(obj, tensors: list[torch.Tensor]):
    """The JSON form of a state tree; tensors go to `tensors` (a DTensor: this rank's local shard)."""
    if type(obj) in _PLAIN:  # most leaves: checked first, a snapshot a step encodes this tree each time
        return obj
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        tensors.append(local.detach())
        return {"__t__": len(tensors) - 1}
    if isinstance(obj, dict):
        return {"__d__": [[_key(k), encode_tree(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_tree(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [encode_tree(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"a snapshot holds tensors and plain values only, not {type(obj).__name__}")


def _key(key):
    if type(key) is str or isinstance(key, int) and not isinstance(key, bool):
        return key
    raise TypeError(f"a snapshot's dict keys are str or int, not {type(key).__name__}")


def decode_tree(obj, tensors: list[torch.Tensor]):
    if isinstance(obj, list):
        return [decode_tree(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__t__" in obj:
            return tensors[obj["__t__"]]
        if "__tuple__" in obj:
            return tuple(decode_tree(v, tensors) for v in obj["__tuple__"])
        return {k: decode_tree(v, tensors) for k, v in obj["__d__"]}
    return obj


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_snapshot(path: Path, *, step: int, tree: dict, meta: dict) -> int:
    """Write `tree` to `path` through a temporary name; returns the bytes written."""
    tensors: list[torch.Tensor] = []
    encoded = encode_tree(tree, tensors)
    views = [_bytes_of(t.cpu()) for t in tensors]
    specs, offset = [], 0
    for tensor, view in zip(tensors, views, strict=True):
        specs.append([str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, view.nbytes])
        offset += view.nbytes
    header = json.dumps({"version": VERSION, "step": step, "meta": meta, "tree": encoded, "tensors": specs,
                         "data_bytes": offset}, separators=(",", ":")).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fp:  # tmpfs: no fsync needed; the rename is what makes it visible
        fp.write(MAGIC + struct.pack("<QI", len(header), zlib.crc32(header)) + header)
        for view in views:
            fp.write(view)
    os.replace(tmp, path)
    return _PREFIX + len(header) + offset


def read_header(path: Path) -> dict | None:
    """The checked header of a complete snapshot file (sizes agree), or None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fp:
            head = fp.read(_PREFIX)
            if len(head) != _PREFIX or head[:len(MAGIC)] != MAGIC:
                return None
            length, crc = struct.unpack("<QI", head[len(MAGIC):])
            if length > MAX_HEADER or _PREFIX + length > size:
                return None
            text = fp.read(length)
            if zlib.crc32(text) != crc:
                return None
            header = json.loads(text.decode())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        return None
    data = header.get("data_bytes")
    if not isinstance(data, int) or size != _PREFIX + length + data:
        return None
    header["_offset"] = _PREFIX + length
    return header


def read_snapshot(path: Path) -> tuple[int, dict, dict] | None:
    """(step, tree, meta) of a complete, undamaged snapshot; None otherwise."""
    header = read_header(path)
    if header is None:
        return None
    try:
        with open(path, "rb") as fp:
            fp.seek(header["_offset"])
            data = bytearray(fp.read())
        if len(data) != header["data_bytes"]:
            return None
        buffer = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        tensors = []
        for dtype, shape, offset, nbytes in header["tensors"]:
            if offset < 0 or nbytes < 0 or offset + nbytes > len(data):
                return None
            raw = buffer[offset:offset + nbytes]
            tensors.append(raw.clone().view(DTYPES[dtype]).reshape(shape))  # clone: aligned, owned
        return int(header["step"]), decode_tree(header["tree"], tensors), header.get("meta") or {}
    except (OSError, KeyError, TypeError, ValueError, IndexError, RuntimeError):
        return None


def newest_files(directory: Path | None, meta: dict, keep: int) -> dict[int, dict]:
    """step -> tree of the `keep` newest complete snapshot files in `directory` taken with `meta`."""
    if directory is None or not directory.is_dir():
        return {}
    for stale in directory.glob(".*.tmp-*"):  # a write its process never finished
        stale.unlink(missing_ok=True)
    found = {}
    for path in sorted(directory.iterdir(), reverse=True):
        step = snapshot_step(path)
        if step is None or len(found) >= keep:
            continue
        header = read_header(path)
        if header is None or header.get("meta") != meta or header.get("step") != step:
            continue
        loaded = read_snapshot(path)
        if loaded is not None:
            found[step] = loaded[1]
    return found
