"""Snapshots cheap enough for every step: two preallocated slot files per rank, filled by one copy.

    tensors = resolve(state)                       # once: the live (key, tensor) pairs, or None
    slots = SlotWriter(directory, tensors, meta)   # rank<k>/slot-0.snap and slot-1.snap, mmap'ed
    slots.write(step, small)                       # one torch._foreach_copy_, then the commit record
    step, tree, meta = read_slot(path_or_bytes)    # None for a torn, partial or foreign slot

torch's state-dict functions cost ~12 ms a call for the tiny model, most of a snapshot: the
list of (name, tensor) pairs they return shares storage with the live parameters and optimizer
states, and those stay the same objects from one step to the next (optimizers update in place),
so it is resolved once; `fingerprint()` notices when an object was replaced. Each write copies
every tensor into the slot the previous write did not use (Gemini-style double buffering,
Wang et al., SOSP '23), so the other slot always holds a whole snapshot.

Slot file: MAGIC, the static header's length (u64) and CRC-32 (u32), the JSON static header
(meta, each tensor's part, key, dtype, shape, offset, size), the tensor bytes at 64-byte aligned
offsets, then the commit record: length (u64), CRC-32 (u32) and the small per-step part (step,
LR schedule, data position, RNG states, optimizer hyperparameters) in snapshot_files' JSON form.
A write first zeroes the commit record, copies, then writes it back: a kill mid-copy leaves a
slot without a valid commit, never a torn one that reads as whole. Data, not code: no pickle.
"""

from __future__ import annotations

import array
import json
import mmap
import os
import struct
import zlib
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from meshrun.checkpoint.snapshot_files import DTYPES, decode_tree, encode_tree
from meshrun.checkpoint.state import inner_optimizers, tensor_state

MAGIC = b"MRSLOT01"
VERSION = 1
ALIGN = 64
_HEAD = len(MAGIC) + 12  # MAGIC, u64 header length, u32 header CRC
_COMMIT = struct.Struct("<QI")  # payload length, payload CRC-32
MIN_COMMIT = 256 << 10  # bytes kept for the per-step part (RNG states are ~16 KB of it)
SLOTS = ("slot-0.snap", "slot-1.snap")
_PLAIN = (type(None), bool, int, float, str)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


def _plain(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _live_objects(state) -> list:
    """Every object whose replacement would make a resolved list stale: the trained parameters (as the
    optimizers hold them) and the optimizer states. A cheap list: it is checked at every snapshot."""
    found = []
    for inner in optimizers_of(state):
        for group in inner.param_groups:
            found += group["params"]
        for per_param in inner.state.values():
            found += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return found


def _inners(opt) -> list:
    inner = inner_optimizers(opt)
    return list(inner) if isinstance(inner, (list, tuple)) else [inner]


def optimizers_of(state) -> list:
    """Every torch optimizer of `state`, in a fixed order."""
    return [inner for opt in state.optimizers for inner in _inners(opt)]


def fingerprint(state) -> tuple:
    """Identity of the live tensors; a resolved list holds them, so an equal print means still valid."""
    return tuple(id(t) for t in _live_objects(state))


def param_groups(state) -> list[list[dict]]:
    """Each optimizer's hyperparameters (the LR the schedule set, betas, ...), read directly."""
    return [[{k: v for k, v in group.items() if k != "params"} for group in inner.param_groups]
            for inner in optimizers_of(state)]


def resolve(state) -> list[tuple[str, str, torch.Tensor]] | None:
    """[(part, key, local tensor)] sharing storage with the live state; None when the fast path cannot hold it."""
    buffers = [b for part in state.model_parts for b in part.buffers()]
    live = {_local(t).untyped_storage().data_ptr() for t in [*_live_objects(state), *buffers]}
    if not all(_plain(v) for groups in param_groups(state) for g in groups for v in g.values()):
        return None
    entries = []
    for part, tree in tensor_state(state).items():
        for key, value in tree.items():
            if isinstance(value, torch.Tensor):
                local = _local(value)
                if local.device.type != "cpu" and not local.is_cuda or local.dtype not in DTYPES.values():
                    return None
                if local.untyped_storage().data_ptr() not in live:
                    return None  # a copy, not the live tensor: it would not follow the training
                entries.append((part, key, local))
            elif not (part == "optim" and key.startswith("param_groups.")):
                return None  # a non-tensor optimizer state: only the state-dict functions read it
    return entries


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def slot_layout(entries, meta: dict, commit_capacity: int) -> tuple[bytes, int, list]:
    """(file prefix, file size, [(offset, nbytes)]) of a slot holding `entries`."""
    specs, places, offset = [], [], 0
    for part, key, tensor in entries:
        nbytes = tensor.numel() * tensor.element_size()
        specs.append([part, key, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes])
        places.append((offset, nbytes))
        offset = _aligned(offset + nbytes)
    # the header's size depends on data_offset's digits: fix the layout with a generous bound first
    draft = {"version": VERSION, "meta": meta, "tensors": specs, "data_offset": 0, "commit_offset": 0,
             "commit_capacity": commit_capacity, "size": 0}
    data_offset = _aligned(_HEAD + len(json.dumps(draft, separators=(",", ":"))) + 64)
    commit_offset = data_offset + offset
    size = _aligned(commit_offset + _COMMIT.size + commit_capacity)
    header = json.dumps({**draft, "data_offset": data_offset, "commit_offset": commit_offset, "size": size},
                        separators=(",", ":")).encode()
    prefix = MAGIC + struct.pack("<QI", len(header), zlib.crc32(header)) + header
    assert len(prefix) <= data_offset
    return prefix, size, [(data_offset + o, n) for o, n in places]


def pack_rng(rng: dict) -> dict:
    """Python's 625-int RNG state as one tensor: encoding it int by int cost 1 ms a snapshot."""
    version, inner, gauss = rng["python"]
    return {**rng, "python": [version, torch.frombuffer(array.array("q", inner), dtype=torch.int64), gauss]}


def _unpack_rng(rng: dict) -> dict:
    version, inner, gauss = rng["python"]
    return {**rng, "python": [version, inner.tolist() if isinstance(inner, torch.Tensor) else inner, gauss]}


def encode_small(step: int, tree: dict) -> bytes:
    tensors: list[torch.Tensor] = []
    encoded = encode_tree(tree, tensors)
    raw = [t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    specs = [[str(t.dtype).removeprefix("torch."), list(t.shape), len(r)] for t, r in zip(tensors, raw, strict=True)]
    head = json.dumps({"step": step, "tree": encoded, "tensors": specs}, separators=(",", ":")).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(raw)


def decode_small(payload: bytes) -> tuple[int, dict]:
    (length,) = struct.unpack_from("<Q", payload)
    head = json.loads(payload[8:8 + length].decode())
    tensors, at = [], 8 + length
    for dtype, shape, nbytes in head["tensors"]:
        if nbytes < 0 or at + nbytes > len(payload):
            raise ValueError("tensor outside the commit record")
        raw = torch.frombuffer(bytearray(payload[at:at + nbytes]), dtype=torch.uint8) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        tensors.append(raw.view(DTYPES[dtype]).reshape(shape))
        at += nbytes
    return int(head["step"]), decode_tree(head["tree"], tensors)


class SlotWriter:
    """This rank's two slot files, mapped once; `write` fills the one not written last."""

    def __init__(self, directory: Path, entries, meta: dict, *, step: int = 0, commit_capacity: int = MIN_COMMIT):
        """Slots of this layout already there (a restarted worker's predecessor's) keep their
        snapshots up to `step`, the one resumed at: a kill at the next write still finds one whole."""
        self.dir, self.sources = Path(directory), [t for _, _, t in entries]
        prefix, self.size, places = slot_layout(entries, meta, commit_capacity)
        self.commit_capacity = commit_capacity
        self.commit_offset = json.loads(prefix[_HEAD:].decode())["commit_offset"]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.maps, self.buffers, self.targets = [], [], []
        self.steps: list[int | None] = [None, None]
        for slot, name in enumerate(SLOTS):
            path = self.dir / name
            peeked = peek_slot(path)
            kept = peeked is not None and peeked[2] == self.size and path.read_bytes()[:len(prefix)] == prefix
            if not kept:
                path.unlink(missing_ok=True)  # never reuse a file of another layout in place
            with open(path, "r+b" if kept else "w+b") as fp:
                os.posix_fallocate(fp.fileno(), 0, self.size)  # ENOSPC here, not SIGBUS at a later write
                mapped = mmap.mmap(fp.fileno(), self.size)
            mapped[:len(prefix)] = prefix
            self.maps.append(mapped)
            if kept and peeked[0] <= step:
                self.steps[slot] = peeked[0]
            else:  # a newer step than the one resumed at belongs to another timeline
                mapped[self.commit_offset:self.commit_offset + _COMMIT.size] = bytes(_COMMIT.size)
            buffer = torch.frombuffer(mapped, dtype=torch.uint8)
            self.buffers.append(buffer)
            self.targets.append([buffer[o:o + n].view(t.dtype).view(t.shape)
                                 for (o, n), t in zip(places, self.sources, strict=True)])
        self.next = min((0, 1), key=lambda i: -1 if self.steps[i] is None else self.steps[i])

    def write(self, step: int, small: dict) -> int | None:
        """Copy the live tensors and `small` into the next slot; returns it (None: the record did not fit)."""
        slot, mapped = self.next, self.maps[self.next]
        payload = encode_small(step, small)
        if len(payload) > self.commit_capacity:
            return None
        mapped[self.commit_offset:self.commit_offset + _COMMIT.size] = bytes(_COMMIT.size)  # invalid while copying
        self.steps[slot] = None
        if self.sources:
            torch._foreach_copy_(self.targets[slot], self.sources)
        start = self.commit_offset + _COMMIT.size
        mapped[start:start + len(payload)] = payload
        mapped[self.commit_offset:start] = _COMMIT.pack(len(payload), zlib.crc32(payload))
        self.steps[slot], self.next = step, 1 - slot
        return slot

    def invalidate(self) -> None:
        for mapped in self.maps:
            mapped[self.commit_offset:self.commit_offset + _COMMIT.size] = bytes(_COMMIT.size)
        self.steps = [None, None]


def _parse(data) -> tuple[dict, int] | None:
    """(static header, step) of a slot whose header and commit record check out."""
    if len(data) < _HEAD or bytes(data[:len(MAGIC)]) != MAGIC:
        return None
    length, crc = struct.unpack_from("<QI", data, len(MAGIC))
    if _HEAD + length > len(data) or zlib.crc32(data[_HEAD:_HEAD + length]) != crc:
        return None
    header = json.loads(bytes(data[_HEAD:_HEAD + length]).decode())
    if header.get("version") != VERSION or header.get("size") != len(data):
        return None
    at = header["commit_offset"]
    size, crc = _COMMIT.unpack_from(data, at)
    if size == 0 or size > header["commit_capacity"] or zlib.crc32(data[at + _COMMIT.size:at + _COMMIT.size + size]) != crc:
        return None
    return header, size


def read_slot(source: Path | bytes | bytearray) -> tuple[int, dict, dict] | None:
    """(step, tree, meta) of a whole slot, from its file or its bytes (a peer's copy); None otherwise."""
    try:
        data = Path(source).read_bytes() if isinstance(source, (str, Path)) else source
        parsed = _parse(memoryview(data))
        if parsed is None:
            return None
        header, size = parsed
        at = header["commit_offset"] + _COMMIT.size
        step, small = decode_small(bytes(data[at:at + size]))
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        tensors: dict[str, dict] = {"model": {}, "optim": {}}
        for part, key, dtype, shape, offset, nbytes in header["tensors"]:
            start = header["data_offset"] + offset
            if offset < 0 or nbytes < 0 or start + nbytes > header["commit_offset"]:
                return None
            tensors[part][key] = buffer[start:start + nbytes].clone().view(DTYPES[dtype]).reshape(shape)
        return step, {**small, "rng": _unpack_rng(small["rng"]), "tensors": tensors}, header.get("meta") or {}
    except (OSError, KeyError, TypeError, ValueError, IndexError, RuntimeError, struct.error, UnicodeDecodeError):
        return None


def peek_slot(path: Path) -> tuple[int, dict, int] | None:
    """(step, meta, size) of a slot file whose header and commit record check out, without its tensors."""
    try:
        with open(path, "rb") as fp:
            size = os.fstat(fp.fileno()).st_size
            head = fp.read(_HEAD)
            if len(head) != _HEAD or head[:len(MAGIC)] != MAGIC:
                return None
            length, crc = struct.unpack_from("<QI", head, len(MAGIC))
            text = fp.read(min(length, 64 << 20))
            if len(text) != length or zlib.crc32(text) != crc:
                return None
            header = json.loads(text.decode())
            if header.get("version") != VERSION or header.get("size") != size:
                return None
            fp.seek(header["commit_offset"])
            record = fp.read(_COMMIT.size)
            n, crc = _COMMIT.unpack(record)
            payload = fp.read(n) if 0 < n <= header["commit_capacity"] else b""
            if not payload or len(payload) != n or zlib.crc32(payload) != crc:
                return None
        (length,) = struct.unpack_from("<Q", payload)
        return int(json.loads(payload[8:8 + length].decode())["step"]), header.get("meta") or {}, size
    except (OSError, KeyError, TypeError, ValueError, struct.error, UnicodeDecodeError):
        return None
