"""Snapshots in a peer host's memory: each rank's slot also lives with the same local rank of the next node.

    peers = PeerCopies.setup(env, area, writer)   # collective, at the first snapshot; None on one node
    peers.exchange(slot)                          # after each snapshot: send ours, receive the previous node's
    held = holdings(area, meta)                   # on resume: every whole snapshot this host holds
    tree, source = fetch(plan, ...)               # the agreed step, from this host or from a peer

After each snapshot rank r sends its slot to rank (r + local_world_size) % world_size and
receives rank (r - local_world_size)'s, on a gloo group of its own, asynchronously: the transfer
overlaps the next step and is waited for at the next snapshot (or at the end), so a peer copy is
at most one snapshot behind. The receiver keeps it in its own launcher's area
(`peer-rank<r>/slot-N.snap`, snapshot_area.py), which outlives its workers; `slot-N.ok` is
written only once the whole transfer arrived, so a sender killed mid-transfer leaves no torn copy.
A host lost with its launcher loses its own area (the next launcher there removes it as stale),
and its ranks then resume from the copies their peers hold (`source` "peer" in events.jsonl).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshrun.checkpoint.snapshot_slots import SLOTS, peek_slot, read_slot

logger = logging.getLogger(__name__)

PEER_TIMEOUT = timedelta(seconds=60)  # a peer's transfer that does not arrive in this long is abandoned


def _peer_dir(area: Path, rank: int) -> Path:
    return area / f"peer-rank{rank}"


class PeerCopies:
    """The ring of slot transfers between nodes, on its own gloo group."""

    def __init__(self, env, area: Path, writer, sizes: list[int]):
        self.env, self.writer = env, writer
        step = env.local_world_size
        self.send_to = (env.rank + step) % env.world_size
        self.recv_from = (env.rank - step) % env.world_size
        self.group = dist.new_group(backend="gloo", timeout=PEER_TIMEOUT)
        self.dir = _peer_dir(area, self.recv_from)
        self.dir.mkdir(parents=True, exist_ok=True)
        size = sizes[self.recv_from]
        self.inbox = []
        for name in SLOTS:
            (self.dir / f"{name}.ok").unlink(missing_ok=True)
            path = self.dir / name
            path.unlink(missing_ok=True)
            with open(path, "w+b") as fp:
                os.posix_fallocate(fp.fileno(), 0, size)  # ENOSPC now, not SIGBUS mid-transfer
            self.inbox.append(torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8))
        self.pending: tuple | None = None  # (works, inbox slot)
        self.sent = 0

    @classmethod
    def setup(cls, env, area: Path | None, writer) -> PeerCopies | None:
        """Every rank calls it at its first snapshot; peer copies only when every rank can hold them."""
        if not (dist.is_initialized() and env.world_size > env.local_world_size > 0):
            return None
        sizes: list = [None] * env.world_size
        dist.all_gather_object(sizes, writer.size if writer is not None and area is not None else None)
        if any(s is None for s in sizes) or env.world_size % env.local_world_size:
            if env.is_main:
                logger.warning("meshrun: snapshots stay on their own host (a rank cannot hold peer copies); "
                               "losing a host resumes from disk")
            return None
        return cls(env, area, writer, sizes)

    def exchange(self, slot: int) -> None:
        """Finish the previous transfer (mark it whole), then send `slot` and receive the peer's."""
        self.wait()
        inbox = self.sent % 2
        (self.dir / f"{SLOTS[inbox]}.ok").unlink(missing_ok=True)
        ops = [dist.P2POp(dist.irecv, self.inbox[inbox], self.recv_from, group=self.group),
               dist.P2POp(dist.isend, self.writer.buffers[slot], self.send_to, group=self.group)]
        self.pending = (dist.batch_isend_irecv(ops), inbox)
        self.sent += 1

    def wait(self) -> None:
        if self.pending is None:
            return
        works, inbox = self.pending
        self.pending = None
        for work in works:
            work.wait()
        (self.dir / f"{SLOTS[inbox]}.ok").touch()


def holdings(area: Path | None, meta: dict) -> list[tuple[int, int, int, str]]:
    """[(saved rank, step, size, path)] of every whole slot in this launcher's area taken by this run's setup."""
    if area is None or not area.is_dir():
        return []
    found = []
    for directory in sorted(area.iterdir()):
        peer = directory.name.startswith("peer-rank")
        if not (peer or directory.name.startswith("rank")) or not directory.is_dir():
            continue
        for name in SLOTS:
            path = directory / name
            if peer and not (directory / f"{name}.ok").exists():
                continue
            peeked = peek_slot(path)
            if peeked is None:
                continue
            step, saved_meta, size = peeked
            rank = saved_meta.get("rank")
            if isinstance(rank, int) and {**saved_meta, "rank": None} == {**meta, "rank": None}:
                found.append((rank, step, size, str(path)))
    return found


def choose(every: list[list], world_size: int, own: list[set[int]]) -> tuple[int | None, dict]:
    """The newest step every rank's state is held at, and {rank: (holder, size, path)} for those fetched.

    `every[h]`: rank h's holdings (saved rank, step, size, path); `own[r]`: steps rank r holds of
    itself in any form (slots or snapshot_files), which it loads without a transfer.
    """
    held: dict[int, set[int]] = {r: set(own[r]) for r in range(world_size)}
    for items in every:
        for rank, step, _, _ in items:
            if 0 <= rank < world_size:
                held[rank].add(step)
    common = set.intersection(*held.values()) if held else set()
    if not common:
        return None, {}
    best = max(common)
    fetch = {}
    for rank in range(world_size):
        if best in own[rank]:
            continue
        holder, size, path = min((h, s, p) for h, items in enumerate(every) for r, st, s, p in items
                                 if r == rank and st == best)
        fetch[rank] = (holder, size, path)
    return best, fetch


def transfer(fetch: dict, rank: int) -> tuple | None:
    """Send what this rank holds for others, receive its own; in one global order (no deadlock)."""
    mine = None
    for target in sorted(fetch):
        holder, size, path = fetch[target]
        if holder == target:
            continue
        if holder == rank:
            data = bytearray(Path(path).read_bytes())
            if len(data) != size:  # replaced since it was announced: send zeros, the receiver rejects them
                data = bytearray(size)
            dist.send(torch.frombuffer(data, dtype=torch.uint8), dst=target)
        elif target == rank:
            box = torch.empty(size, dtype=torch.uint8)
            dist.recv(box, src=holder)
            mine = read_slot(box.numpy().tobytes())
    return mine
