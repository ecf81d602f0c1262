"""Periodic, preemption and final checkpoints of a training run, and resuming from the latest valid one.

    with Checkpointer(cfg.checkpoint, run_dir=run_dir, env=env, layout={"strategy": "fsdp", ...}) as ckpt:
        ckpt.resume(state)                   # before the loop: latest valid checkpoint, if any
        for step in ...:
            ...
            ckpt.step_done(state)            # every `interval` steps; on SIGTERM/SIGINT: save, raise Preempted
        ckpt.finish(state)                   # a final checkpoint, waits for a background write

While open, a Checkpointer holds SIGTERM/SIGINT (preemption.py); closing it, by any path, puts
the previous handlers back. Which checkpoint to resume from is selection.py's choice.

A save goes to `step-N.tmp-<session>`; after `dcp.save` returns on rank 0 every rank has written
(DCP's finish step gathers all ranks' write results), so rank 0 then writes the manifest, renames
the directory to `step-N` and moves `latest`. A crash before that leaves only a .tmp directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint import safe_load, selection
from meshrun.checkpoint import write_fault as wf
from meshrun.checkpoint.preemption import Preempted, PreemptionSignals, write_marker
from meshrun.checkpoint.retire import retire
from meshrun.checkpoint.samples import SampleLog
from meshrun.checkpoint.snapshot import Snapshots
from meshrun.checkpoint.staging import OwnedStager
from meshrun.checkpoint.state import (
    TrainState,
    apply_tensor_state,
    apply_train_state,
    check_base,
    rng_state,
    set_rng_state,
    tensor_state,
    train_state,
)
from meshrun.checkpoint.verify import check_fits
from meshrun.errors import DiskWriteError
from meshrun.runtime import process
from meshrun.runtime.diskfault import disk_fault
from meshrun.runtime.process import DistEnv

logger = logging.getLogger(__name__)

# Test hook: "ckpt_write:STEP" makes the last rank die (SIGKILL) in the middle of the write of
# step STEP, after its RNG file and before the tensors, on the first attempt only: a torn write.
FAULT_ENV = "MESHRUN_FAULT"


class Checkpointer:
    """Owns the run's checkpoint directory: save (sync or async), commit, keep K, resume, preemption."""

    def __init__(self, cfg, *, run_dir: Path, env: DistEnv, layout: dict):
        self.cfg, self.env = cfg, env
        self.layout = {"world_size": env.world_size, **layout}  # recorded, shown by `meshrun ckpt inspect`
        self.run_dir = Path(run_dir)
        config_file = self.run_dir / "config.toml"
        self.config_toml = config_file.read_text() if config_file.is_file() else ""
        self.root = mf.checkpoints_dir(run_dir)
        self.session = _broadcast(time.time_ns() if env.is_main else None)
        self.resumed_from: Path | None = None
        self.samples: SampleLog | None = None
        self._pending: tuple | None = None  # (future, tmp dir, step) of a background save
        self._last_saved = -1
        self._async_group = None
        self._stager = None
        self._signals: PreemptionSignals | None = PreemptionSignals()
        self.snapshots = Snapshots(cfg, run_dir=self.run_dir, env=env, layout=self.layout, config_toml=self.config_toml)
        runtime = process.peek()  # meshrun.shutdown() closes a Checkpointer the loop left open
        self._runtime_undo = runtime.undo if runtime is not None else None
        if self._runtime_undo is not None:
            self._runtime_undo.append(self.close)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- resume --------------------------------------------------------------------------------

    def resume(self, state: TrainState) -> Path | None:
        """Load the checkpoint `cfg.resume` names ('auto': the newest valid one) into `state`."""
        chosen = None
        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            selection.drop_uncommitted(self.root, session=self.session)
            try:
                found = selection.choose(self.root, self.cfg.resume, session=self.session)
                chosen = None if found is None else str(found)
            except mf.CheckpointError as exc:
                chosen = exc  # raised on every rank below, not only here
        chosen = _broadcast(chosen)
        if isinstance(chosen, mf.CheckpointError):
            raise chosen
        disk = None if chosen is None else Path(chosen)  # a newer in-memory snapshot wins (snapshot.py)
        if self.snapshots.resume(state, disk=disk, load_disk=lambda path: self._load(path, state)) == "disk":
            self.resumed_from, self._last_saved = disk, state.step
        loader = state.train_loader
        self.samples = SampleLog(self.run_dir, enabled=bool(getattr(self.cfg, "sample_log", False)),
                                 rank=self.env.rank, session=self.session, loader=loader)
        self.samples.begin_step()
        return self.resumed_from

    def _load(self, path: Path, state: TrainState) -> None:
        tensors = tensor_state(state)
        saved = torch.load(path / mf.TRAIN_STATE, weights_only=True)
        check_base(state, saved, path)  # a LoRA run's base weights: before the shapes, which it explains
        check_fits(path, _whole_model_shapes(tensors["model"]))  # before anything of it is loaded
        safe_load.load(tensors, path)
        apply_tensor_state(state, tensors)
        apply_train_state(state, saved)
        rng_file = path / "rng" / f"rank-{self.env.rank:05d}.pt"
        if saved["layout"].get("world_size") == self.env.world_size and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=True))
        if self.env.is_main:
            before = saved["layout"]
            logger.warning("meshrun: resumed from %s (step %d, saved on %s)", path, state.step, _describe(before))

    # -- save ----------------------------------------------------------------------------------

    def step_done(self, state: TrainState) -> None:
        """After each optimizer step: sample log, finish a background save, interval/preemption saves."""
        self.samples.end_step(state.step)
        self.samples.begin_step()
        self._poll()
        signum = self._signals.agreed(self.env.world_size, self.env.device) if self._signals else 0
        if signum:
            self.save(state, blocking=True)
            if self.env.is_main:
                write_marker(self.root, step=state.step, signum=signum, session=self.session)
            self.close()
            raise Preempted(state.step, signum)
        if self.cfg.interval and state.step % self.cfg.interval == 0:
            self.save(state, blocking=not self.cfg.async_save)
        self.snapshots.step_done(state)

    def finish(self, state: TrainState, *, final_save: bool = True) -> None:
        """A last checkpoint at the final step (when checkpoints are on and `final_save`); waits for
        any background write."""
        if final_save and self.cfg.interval and self._last_saved != state.step:
            self.save(state, blocking=True)
        self._wait()
        self.snapshots.finish()  # the last peer-host copy (snapshot_peer.py)
        self.close()

    def close(self) -> None:
        """Put back the signal handlers and free the staging buffers (idempotent, any exit path)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._signals is not None:
            self._signals.restore()
            self._signals = None
        if self._runtime_undo is not None and self.close in self._runtime_undo:
            self._runtime_undo.remove(self.close)

    def save(self, state: TrainState, *, blocking: bool = True) -> None:
        """Write step `state.step` to a .tmp directory, then commit it (now, or when a background write ends).

        A write that fails on a full, read-only or failing disk raises DiskWriteError on every
        rank, after the .tmp directory is removed; the previous checkpoint and `latest` stay.
        Announced to the hang watchdog: a save may take longer than a step.
        """
        with process.phase("checkpoint"):
            self._save(state, blocking=blocking)

    def _save(self, state: TrainState, *, blocking: bool) -> None:
        self._wait()  # one write at a time
        if self._last_saved == state.step:
            return
        tmp = self.root / f"{mf.step_dir_name(state.step)}.tmp-{self.session}"
        local = None
        try:
            (tmp / "rng").mkdir(parents=True, exist_ok=True)
            torch.save(rng_state(), tmp / "rng" / f"rank-{self.env.rank:05d}.pt")
            if self.env.is_main:
                torch.save(train_state(state, layout=self.layout, config_toml=self.config_toml), tmp / mf.TRAIN_STATE)
        except (OSError, RuntimeError) as exc:
            local = wf.write_failure(exc)
            if local is None:
                raise
        tensors = tensor_state(state)
        needed = wf.state_bytes(tensors)  # the size estimate a failure names, if no checkpoint is on disk yet
        failed = wf.first_failure(local)  # every rank stops together, not only the one whose write failed
        if failed is not None:
            raise self._write_failed(failed, tmp, needed)
        _maybe_fault(state.step, self.env)
        self._last_saved = state.step
        if blocking:
            try:
                dcp.save(tensors, checkpoint_id=str(tmp))
            except (CheckpointException, OSError, RuntimeError) as exc:
                raise self._write_failed_or(exc, tmp, needed) from None
            self._commit(tmp, state.step, needed)
        else:
            if self._async_group is None and dist.get_world_size() > 1:
                # DCP's collectives run in a background thread: give them their own group, never
                # interleaved with the training's collectives on the default one.
                self._async_group = dist.new_group(backend="gloo")
            if self._stager is None:  # kept across saves: its copies are reused, only memcpy blocks
                self._stager = OwnedStager(self._async_group, pin_memory=torch.cuda.is_available())
            future = dcp.async_save(tensors, checkpoint_id=str(tmp), process_group=self._async_group,
                                    async_stager=self._stager, planner=self._stager.planner())
            self._pending = (getattr(future, "upload_completion", future), tmp, state.step, needed)

    def _poll(self) -> None:
        if self._pending is not None and self._pending[0].done():
            self._wait()

    def _wait(self) -> None:
        if self._pending is None:
            return
        future, tmp, step, needed = self._pending
        self._pending = None
        try:
            future.result()
        except (CheckpointException, OSError, RuntimeError) as exc:
            raise self._write_failed_or(exc, tmp, needed) from None
        self._commit(tmp, step, needed)

    def _write_failed_or(self, exc: BaseException, tmp: Path, needed: int | None) -> BaseException:
        """DiskWriteError for a write that failed on the disk, else `exc` itself (a real bug)."""
        failed = wf.write_failure(exc)
        return exc if failed is None else self._write_failed(failed, tmp, needed)

    def _write_failed(self, exc: OSError, tmp: Path, estimate: int | None) -> DiskWriteError:
        # Every rank has stopped writing: rank 0 frees what the failed write took, and the others
        # wait for that, so that their one line reaches their log on the same full disk.
        key = f"meshrun/ckpt_write_failed/{self.session}/{tmp.name}"
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        wf.store_signal(key, set_it=self.env.is_main)
        needed = wf.checkpoint_bytes(self.root) or estimate  # the last checkpoint's size, when there is one
        return wf.write_failed(exc, tmp=tmp, root=self.root, needed=needed)

    def _commit(self, tmp: Path, step: int, needed: int | None = None) -> None:
        """Rank 0, after every rank has written: manifest, atomic rename, `latest`, keep the last K."""
        if not self.env.is_main:
            return
        final = self.root / mf.step_dir_name(step)
        try:
            mf.write_manifest(tmp, step=step, layout=self.layout, session=self.session, time=time.time())
            if final.exists():  # the same step saved again (a redone step after a restart)
                retire(final, f"step {step} was saved again", tag=self.session)
            os.replace(tmp, final)
            mf.write_latest(self.root, final.name)
        except OSError as exc:
            if disk_fault(exc) is None:
                raise
            raise self._write_failed(exc, tmp, needed) from None
        for old in mf.committed(self.root)[self.cfg.keep:]:
            retire(old, f"older than the last {self.cfg.keep} (checkpoint.keep)", tag=self.session)
        logger.info("meshrun: checkpoint %s committed", final)


def _broadcast(value):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _whole_model_shapes(model: dict) -> dict[str, tuple[int, ...]]:
    """name -> global shape over every rank's model parts (pipeline stages differ by rank)."""
    shapes = {name: tuple(t.shape) for name, t in model.items()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, shapes)
        for part in every:
            shapes.update(part)
    return shapes


def _describe(layout: dict) -> str:
    degrees = ", ".join(f"{k} {v}" for k, v in layout.items() if k not in ("world_size", "strategy") and v != 1)
    return f"{layout.get('world_size')} processes, {layout.get('strategy')}" + (f" ({degrees})" if degrees else "")


def _maybe_fault(step: int, env: DistEnv) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if (spec == f"ckpt_write:{step}" and env.rank == env.world_size - 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)
