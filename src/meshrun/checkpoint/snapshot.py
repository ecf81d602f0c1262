"""In-memory snapshots: every `checkpoint.snapshot_interval` steps each rank copies its state to /dev/shm.

    snaps = Snapshots(cfg.checkpoint, run_dir=run_dir, env=env, layout=layout)
    source = snaps.resume(state, disk=checkpoint_path, load_disk=...)   # "snapshot", "disk" or None
    snaps.step_done(state)                                             # after every optimizer step

What a snapshot holds is what a disk checkpoint holds (checkpoint/state.py): this rank's model
and optimizer tensors (a DTensor's local shard), the LR schedule, the data position and the RNG
states, taken at the same point of the step. They live in the launcher's directory
(snapshot_area.py, `MESHRUN_SNAPSHOT_DIR`), `rank<k>/step-N.snap`, which outlives the workers:
a restart on the same host reads memory instead of disk and redoes at most the steps since the
last snapshot. Each rank keeps its two newest (the ranks are at most one snapshot apart when
one dies), and a new one is renamed into place only once complete (snapshot_files.py).

On resume, after the process group exists, the ranks agree in one collective on the newest step
that every rank holds a complete snapshot of, taken by the same world size, layout and config;
when it is newer than the disk checkpoint it is loaded, else the disk checkpoint as before. The
idea is Gemini's (Wang et al., SOSP '23): checkpoints in memory, recovery at memory speed.
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
    read_header,
    read_snapshot,
    snapshot_name,
    snapshot_step,
    write_snapshot,
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
from meshrun.runtime import events

logger = logging.getLogger(__name__)

KEEP = 2  # per rank: the newest, and the one before while the next is written
AUTO_BUDGET = 0.02  # 'auto': snapshots may cost this fraction of the step time
AUTO_STEPS = 3  # 'auto': steps timed after the first snapshot before the interval is chosen
MAX_AUTO = 1000
ROOM_MARGIN = 64 << 20  # bytes left free in /dev/shm beyond what the snapshots take


class Snapshots:
    """This rank's snapshot directory: write every N steps, agree and load on resume, remove at the end."""

    def __init__(self, cfg, *, run_dir: Path, env, layout: dict, config_toml: str = ""):
        self.env, self.run_dir, self.layout = env, Path(run_dir), layout
        self.interval = fixed_interval(getattr(cfg, "snapshot_interval", 0))  # None: 'auto'
        root = os.environ.get(ENV)
        self.dir = Path(root) / f"rank{env.rank}" if root and self.interval != 0 else None
        self._cost: float | None = None  # 'auto': seconds the first snapshot took
        self._clock = (0, 0.0)  # 'auto': (step, perf_counter) after it
        self.meta = {"world_size": env.world_size, "rank": env.rank, "layout": layout,
                     "config_sha256": hashlib.sha256(config_toml.encode()).hexdigest()}
        self.written = 0  # snapshots this process wrote
        self._checked_room = False
        self._first_step = True
        events.record(self.run_dir, "checkpointer_ready")

    # -- resume --------------------------------------------------------------------------------

    def _candidates(self) -> dict[int, tuple]:
        """step -> (tree) of this rank's complete snapshots that fit this run, newest KEEP only."""
        if self.dir is None or not self.dir.is_dir():
            return {}
        for stale in self.dir.glob(".*.tmp-*"):  # a write its process never finished
            stale.unlink(missing_ok=True)
        found = {}
        for path in sorted(self.dir.iterdir(), reverse=True):
            step = snapshot_step(path)
            if step is None or len(found) >= KEEP:
                continue
            header = read_header(path)
            if header is None or header.get("meta") != self.meta or header.get("step") != step:
                continue
            loaded = read_snapshot(path)
            if loaded is not None:
                found[step] = loaded[1]
        return found

    def resume(self, state: TrainState, *, disk: Path | None, load_disk) -> str | None:
        """Load the newer of the agreed snapshot and `disk` (via `load_disk(path)`); says which."""
        events.record(self.run_dir, "resume_start")
        mine = self._candidates()
        common = set(mine)
        if dist.is_initialized() and dist.get_world_size() > 1:
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, sorted(mine))  # the one collective of the choice
            for steps in every:
                common &= set(steps)
        source = None
        best = max(common) if common else None
        disk_step = int(mf.read_manifest(disk)["step"]) if disk is not None and best is not None else -1
        if best is not None and best > disk_step:
            self._load(state, mine[best])
            source = "snapshot"
            if self.env.is_main:
                logger.warning("meshrun: resumed from the in-memory snapshot of step %d (%s); the newest disk "
                               "checkpoint is %s", best, self.dir.parent, "none" if disk is None else disk.name)
        elif disk is not None:
            load_disk(disk)
            source = "disk"
        events.record(self.run_dir, "resumed", source=source, step=state.step,
                      snapshot_step=best, disk=None if disk is None else disk.name)
        return source

    def _load(self, state: TrainState, tree: dict) -> None:
        current = tensor_state(state)  # the live tensors, filled in place as DCP's load fills them
        saved = tree["tensors"]
        for part in ("model", "optim"):
            if saved[part].keys() != current[part].keys():
                raise RuntimeError(f"snapshot {part} keys differ from the live state's")  # meta check passed
            for key, value in saved[part].items():
                live = current[part][key]
                if hasattr(live, "copy_"):
                    local = live.to_local() if hasattr(live, "to_local") else live
                    local.copy_(value)
                else:
                    current[part][key] = value
        apply_tensor_state(state, current)
        apply_train_state(state, tree["train"])
        set_rng_state(tree["rng"])

    # -- save ----------------------------------------------------------------------------------

    def step_done(self, state: TrainState) -> None:
        """After each optimizer step: a snapshot every `interval` steps (synchronous: a memcpy to tmpfs)."""
        now = time.perf_counter()
        if self._first_step:
            self._first_step = False
            events.record(self.run_dir, "first_step", step=state.step)
        if self.interval is None:  # 'auto', on every rank alike (a collective), with or without a directory
            self._auto(state, now)
        elif self.interval and state.step % self.interval == 0:
            self._write(state)

    def _auto(self, state: TrainState, now: float) -> None:
        """Snapshot once, time it, then after AUTO_STEPS steps agree on the interval (one all_reduce MAX)."""
        if self._cost is None:
            started = time.perf_counter()
            self._write(state)
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
            logger.info("meshrun: in-memory snapshots every %d steps (one takes %.1f ms, a step %.1f ms)",
                        self.interval, self._cost * 1e3, step_s * 1e3)
        if state.step % self.interval == 0:
            self._write(state)

    def _write(self, state: TrainState) -> None:
        if self.dir is None:
            return
        tree = {"tensors": tensor_state(state), "rng": rng_state(),
                "train": train_state(state, layout=self.layout, config_toml="")}
        if not self._checked_room and not self._room_for(tree):
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_snapshot(self.dir / snapshot_name(state.step), step=state.step, tree=tree, meta=self.meta)
        except OSError as exc:  # tmpfs full after all: disk checkpoints go on, snapshots stop
            logger.warning("meshrun: rank %d: in-memory snapshots stop (%s: %s); disk checkpoints go on",
                           self.env.rank, self.dir, exc.strerror or exc)
            self.dir = None
            return
        self.written += 1
        finished = sorted((p for p in self.dir.iterdir() if snapshot_step(p) is not None), reverse=True)
        for old in finished[KEEP:]:
            old.unlink(missing_ok=True)

    def _room_for(self, tree: dict) -> bool:
        """Once: refuse (one line, snapshots off) when /dev/shm cannot hold KEEP + 1 of every local rank's."""
        from meshrun.checkpoint.write_fault import state_bytes

        self._checked_room = True
        need = (KEEP + 1) * state_bytes(tree["tensors"]) * max(1, self.env.local_world_size) + ROOM_MARGIN
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
