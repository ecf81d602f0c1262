"""In-memory snapshots: every `checkpoint.snapshot_interval` steps each rank copies its state to /dev/shm.

    snaps = Snapshots(cfg.checkpoint, run_dir=run_dir, env=env, layout=layout)
    source = snaps.resume(state, disk=checkpoint_path, load_disk=...)   # "snapshot", "peer", "disk" or None
    snaps.step_done(state)                                             # after every optimizer step
    snaps.finish()                                                     # at the end: the last peer copy

What a snapshot holds is what a disk checkpoint holds (checkpoint/state.py): this rank's model
and optimizer tensors (a DTensor's local shard), the LR schedule, the data position and the RNG
states, taken at the same point of the step. They live in the launcher's directory
(snapshot_area.py, `MESHRUN_SNAPSHOT_DIR`), which outlives the workers: a restart on the same
host reads memory instead of disk and redoes at most the steps since the last snapshot. The
per-step path copies the live tensors into two preallocated slots (snapshot_slots.py); the
general path (an optimizer with non-tensor state) writes `step-N.snap` files (snapshot_files.py).
Across nodes each slot is also copied to a peer host's memory (snapshot_peer.py).

On resume, after the process group exists, the ranks agree in one collective on the newest step
at which every rank's state is held on some host, taken by the same world size, layout and
config; when it is newer than the disk checkpoint it is loaded (a rank whose state is on another
host receives it first), else the disk checkpoint as before. The idea is Gemini's (Wang et al.,
SOSP '23): checkpoints in memory, recovery at memory speed, with copies on peer hosts.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint.snapshot_area import ENV, fixed_interval
from meshrun.checkpoint.snapshot_files import (
    newest_files,
    snapshot_name,
    snapshot_step,
    write_snapshot,
)
from meshrun.checkpoint.snapshot_peer import PeerCopies, choose, holdings, transfer
from meshrun.checkpoint.snapshot_slots import (
    SlotWriter,
    fingerprint,
    optimizers_of,
    pack_rng,
    param_groups,
    read_slot,
    resolve,
)
from meshrun.checkpoint.state import (
    TrainState,
    apply_tensor_state,
    apply_train_state,
    rng_state,
    set_rng_state,
    tensor_state,
    train_state,
)
from meshrun.checkpoint.write_fault import state_bytes
from meshrun.runtime import events

logger = logging.getLogger(__name__)

KEEP = 2  # per rank: the newest, and the one before while the next is written
AUTO_BUDGET = 0.02  # 'auto': snapshots may cost this fraction of the step time
AUTO_STEPS = 3  # 'auto': steps timed after the first snapshot before the interval is chosen
MAX_AUTO = 1000
ROOM_MARGIN = 64 << 20  # bytes left free in /dev/shm beyond what the snapshots take


class Snapshots:
    """This rank's snapshots: write every N steps, agree and load on resume, copy to a peer host."""

    def __init__(self, cfg, *, run_dir: Path, env, layout: dict, config_toml: str = ""):
        self.env, self.run_dir, self.layout = env, Path(run_dir), layout
        self.interval = fixed_interval(getattr(cfg, "snapshot_interval", 0))  # None: 'auto'
        root = os.environ.get(ENV)
        self.area = Path(root) if root and self.interval != 0 else None
        self.dir = self.area / f"rank{env.rank}" if self.area is not None else None
        self._cost: float | None = None  # 'auto': seconds a (steady) snapshot took
        self._clock = (0, 0.0)  # 'auto': (step, perf_counter) after it
        self.meta = {"world_size": env.world_size, "rank": env.rank, "layout": layout,
                     "config_sha256": hashlib.sha256(config_toml.encode()).hexdigest()}
        self.written = 0  # snapshots this process wrote
        self._checked_room = False
        self._first_step = True
        self.slots: SlotWriter | None = None  # the per-step fast path (snapshot_slots.py), from the first write
        self.peers: PeerCopies | None = None
        self._ready = False  # fast path and peers decided (every rank at its first write)
        self._print: tuple = ()
        self._resumed = 0  # the step this process started from: older slots stay valid
        events.record(self.run_dir, "checkpointer_ready")

    # -- resume --------------------------------------------------------------------------------

    def resume(self, state: TrainState, *, disk: Path | None, load_disk) -> str | None:
        """Load the newer of the agreed snapshot and `disk` (via `load_disk(path)`); says which.

        "snapshot": from this host's memory, "peer": this rank's state came from another host's copy."""
        events.record(self.run_dir, "resume_start")
        files = newest_files(self.dir, self.meta, KEEP)  # the general path's snapshots
        slots = holdings(self.area, self.meta)
        own = set(files) | {step for rank, step, _, _ in slots if rank == self.env.rank}
        every = [(sorted(own), slots)]
        multi = dist.is_initialized() and dist.get_world_size() > 1
        if multi:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, (sorted(own), slots))  # the one collective of the choice
        best, fetch = choose([e[1] for e in every], len(every), [set(e[0]) for e in every])
        disk_step = int(mf.read_manifest(disk)["step"]) if disk is not None and best is not None else -1
        tree, source = None, None
        if best is not None and best > disk_step:
            fetched = transfer(fetch, self.env.rank) if multi else None
            if self.env.rank in fetch:
                tree, source = (fetched[1] if fetched is not None and fetched[0] == best else None), "peer"
            else:
                tree, source = self._own(best, files, slots), "snapshot"
            if not _agree_min(int(tree is not None), self.env.device):  # all or none load it
                tree, source = None, None
        if tree is not None:
            self._load(state, tree)
            if self.env.is_main:
                logger.warning("meshrun: resumed from the in-memory snapshot of step %d (%s%s); the newest disk "
                               "checkpoint is %s", best, self.area,
                               f"; ranks {sorted(fetch)} from a peer host's copy" if fetch else "",
                               "none" if disk is None else disk.name)
        elif disk is not None:
            load_disk(disk)
            source = "disk"
        self._resumed = state.step
        events.record(self.run_dir, "resumed", source=source, step=state.step, snapshot_step=best,
                      disk=None if disk is None else disk.name,
                      peer_from=fetch[self.env.rank][0] if source == "peer" else None)
        return source

    def _own(self, step: int, files: dict, slots: list) -> dict | None:
        if step in files:
            return files[step]
        for rank, held, _, path in slots:
            if rank == self.env.rank and held == step:
                loaded = read_slot(Path(path))
                if loaded is not None and loaded[0] == step:
                    return loaded[1]
        return None

    def _load(self, state: TrainState, tree: dict) -> None:
        current = tensor_state(state)  # the live tensors, filled in place as DCP's load fills them
        saved = tree["tensors"]
        for part in ("model", "optim"):
            # slots keep the optimizer's hyperparameters in tree["groups"], not as param_groups.* keys
            expected = {k for k in current[part] if "groups" not in tree or not k.startswith("param_groups.")}
            if saved[part].keys() != expected:
                raise RuntimeError(f"snapshot {part} keys differ from the live state's")  # meta check passed
            for key, value in saved[part].items():
                live = current[part][key]
                if hasattr(live, "copy_"):
                    local = live.to_local() if hasattr(live, "to_local") else live
                    local.copy_(value)
                else:
                    current[part][key] = value
        apply_tensor_state(state, current)
        for live, groups in zip((o.param_groups for o in optimizers_of(state)), tree.get("groups") or [], strict=False):
            for group, values in zip(live, groups, strict=True):
                group.update(values)
        apply_train_state(state, tree["train"])
        set_rng_state(tree["rng"])

    # -- save ----------------------------------------------------------------------------------

    def step_done(self, state: TrainState) -> None:
        """After each optimizer step: a snapshot every `interval` steps (synchronous: a memory copy)."""
        now = time.perf_counter()
        if self._first_step:
            self._first_step = False
            events.record(self.run_dir, "first_step", step=state.step)
        if self.interval is None:  # 'auto', on every rank alike (a collective), with or without a directory
            self._auto(state, now)
        elif self.interval and state.step % self.interval == 0:
            self._write(state)

    def finish(self) -> None:
        """At the end of a run: wait for the last peer transfer, so the peer holds the final snapshot."""
        if self.peers is not None:
            self.peers.wait()

    def _auto(self, state: TrainState, now: float) -> None:
        """Snapshot, time a steady one, then after AUTO_STEPS steps agree on the interval (one all_reduce MAX)."""
        if self._cost is None:
            started = time.perf_counter()
            if self._write(state):  # the first write also sets up the slots: it does not count
                self._cost, self._clock = time.perf_counter() - started, (state.step, time.perf_counter())
            return
        first_step, since = self._clock
        if state.step - first_step < AUTO_STEPS:
            return
        step_s = (now - since) / (state.step - first_step)
        local = max(1, min(MAX_AUTO, math.ceil(self._cost / (AUTO_BUDGET * step_s))))
        self.interval = _agree_max(local, self.env.device)
        events.record(self.run_dir, "snapshot_interval", interval=self.interval, cost_s=round(self._cost, 5),
                      step_s=round(step_s, 5))
        if self.env.is_main:
            logger.info("meshrun: in-memory snapshots every %d steps (one takes %.2f ms, a step %.1f ms)",
                        self.interval, self._cost * 1e3, step_s * 1e3)
        if state.step % self.interval == 0:
            self._write(state)

    def _setup(self, state: TrainState) -> None:
        """Once, on every rank: resolve the live tensors into slots, then the peer ring (a collective)."""
        self._ready = True
        entries = resolve(state) if self.dir is not None else None
        if entries is not None and self._room_for(sum(t.numel() * t.element_size() for _, _, t in entries)):
            try:
                self.slots = SlotWriter(self.dir, entries, self.meta, step=self._resumed)
                self._print = fingerprint(state)
            except OSError as exc:
                self._stop(exc)
        self.peers = PeerCopies.setup(self.env, self.area, self.slots)

    def _write(self, state: TrainState) -> bool:
        """One snapshot; False when this was the first (it set up the slots and the peer ring)."""
        steady = self._ready
        if not steady:
            self._setup(state)
        slot = None
        if self.slots is not None and fingerprint(state) != self._print:
            logger.warning("meshrun: rank %d: the optimizer or model replaced a tensor; snapshots go on "
                           "through the state-dict functions, not shared with a peer host", self.env.rank)
            self.slots.invalidate()
            self.slots = None
        if self.slots is not None:
            small = {"train": train_state(state, layout=self.layout, config_toml=""), "rng": pack_rng(rng_state()),
                     "groups": param_groups(state)}
            slot = self.slots.write(state.step, small)
        if slot is None and self.dir is not None:
            self._write_file(state)
        else:
            self.written += slot is not None
        if self.peers is not None:  # every rank, every snapshot: the ring's sends and receives pair up
            self.peers.exchange(slot if slot is not None else self.peers.writer.next)
        return steady

    def _write_file(self, state: TrainState) -> None:
        """The general path (snapshot_files.py): the state-dict functions, then a file renamed into place."""
        tree = {"tensors": tensor_state(state), "rng": rng_state(),
                "train": train_state(state, layout=self.layout, config_toml="")}
        if not self._checked_room and not self._room_for(state_bytes(tree["tensors"])):
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_snapshot(self.dir / snapshot_name(state.step), step=state.step, tree=tree, meta=self.meta)
        except OSError as exc:  # tmpfs full after all: disk checkpoints go on, snapshots stop
            self._stop(exc)
            return
        self.written += 1
        finished = sorted((p for p in self.dir.iterdir() if snapshot_step(p) is not None), reverse=True)
        for old in finished[KEEP:]:
            old.unlink(missing_ok=True)

    def _stop(self, exc: OSError) -> None:
        logger.warning("meshrun: rank %d: in-memory snapshots stop (%s: %s); disk checkpoints go on",
                       self.env.rank, self.dir, exc.strerror or exc)
        self.dir = None

    def _room_for(self, nbytes: int) -> bool:
        """Once: refuse (one line, snapshots off) when /dev/shm cannot hold them for every local rank."""
        self._checked_room = True
        copies = KEEP + 1 + (KEEP if self.env.world_size > self.env.local_world_size else 0)  # + a peer's
        need = copies * nbytes * max(1, self.env.local_world_size) + ROOM_MARGIN
        free = shutil.disk_usage(self.dir.parent).free
        if free >= need:
            return True
        if self.env.local_rank == 0:
            logger.warning("meshrun: in-memory snapshots off: %s has %.1f MiB free, they need about %.1f MiB; "
                           "disk checkpoints go on (set checkpoint.snapshot_interval=0 to silence this)",
                           self.dir.parent, free / 2**20, need / 2**20)
        self.dir = None
        return False


def _agree_max(value: int, device) -> int:
    """The largest of every rank's value: all ranks then snapshot the same steps."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())


def _agree_min(value: int, device) -> int:
    return -_agree_max(-value, device)
