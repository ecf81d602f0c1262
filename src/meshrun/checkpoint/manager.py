"""Periodic, preemption and final checkpoints of a training run, and resuming from the latest valid one.

    checkpointer = Checkpointer(cfg.checkpoint, run_dir=run_dir, env=env, layout={"strategy": "fsdp", ...})
    checkpointer.resume(state)               # before the loop: latest valid checkpoint, if any
    for step in ...:
        ...
        checkpointer.step_done(state)        # every `interval` steps; on SIGTERM/SIGINT: save, raise Preempted
    checkpointer.finish(state)               # a final checkpoint, waits for a background write

A save goes to `step-N.tmp-<session>`; after `dcp.save` returns on rank 0 every rank has written
(DCP's finish step gathers all ranks' write results), so rank 0 then writes the manifest, renames
the directory to `step-N` and moves `latest`. A crash before that leaves only a .tmp directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint.samples import SampleLog
from meshrun.checkpoint.state import (
    apply_tensor_state,
    apply_train_state,
    rng_state,
    set_rng_state,
    tensor_state,
    train_state,
)
from meshrun.checkpoint.verify import check_fits
from meshrun.runtime.process import DistEnv
from meshrun.train.state import TrainState

logger = logging.getLogger(__name__)

PREEMPTED_FILE = "preempted.json"
# Test hook: "ckpt_write:STEP" makes the last rank die (SIGKILL) in the middle of the write of
# step STEP, after its RNG file and before the tensors, on the first attempt only: a torn write.
FAULT_ENV = "MESHRUN_FAULT"


class Preempted(Exception):  # noqa: N818 - a control-flow signal, not an error
    """SIGTERM/SIGINT arrived; a checkpoint of `step` is committed and the worker should exit 0."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint committed")
        self.step, self.signum = step, signum


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
        self._signal, self._signal_at = 0, 0.0
        self._old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    # -- resume --------------------------------------------------------------------------------

    def resume(self, state: TrainState) -> Path | None:
        """Load the checkpoint `cfg.resume` names ('auto': the newest valid one) into `state`."""
        chosen = None
        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            self._drop_uncommitted()
            try:
                found = self._choose()
                chosen = None if found is None else str(found)
            except mf.CheckpointError as exc:
                chosen = exc  # raised on every rank below, not only here
        chosen = _broadcast(chosen)
        if isinstance(chosen, mf.CheckpointError):
            raise chosen
        if chosen is not None:
            self._load(Path(chosen), state)
            self.resumed_from = Path(chosen)
            self._last_saved = state.step
        loader = state.train_loader
        self.samples = SampleLog(self.run_dir, enabled=bool(getattr(self.cfg, "sample_log", False)),
                                 rank=self.env.rank, session=self.session, loader=loader)
        self.samples.begin_step()
        return self.resumed_from

    def _choose(self) -> Path | None:
        """auto: the newest valid; never / PATH: that, but a restart (--max-restarts) keeps this job's progress."""
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        if self.cfg.resume == "auto" or (self.cfg.resume == "never" and restart):
            return self._latest_valid()
        if self.cfg.resume == "never":
            self._abandon_after(0, "starting fresh (--resume never)")
            return None
        path = Path(self.cfg.resume)
        bad = mf.problem(path)
        if bad:
            raise mf.CheckpointError(f"checkpoint.resume={self.cfg.resume!r}: {bad}")
        step = int(mf.read_manifest(path)["step"])
        if restart:
            own = self._latest_valid()
            return own if own is not None and int(mf.read_manifest(own)["step"]) > step else path
        self._abandon_after(step, f"resuming from {path} (step {step})", keep=path)
        return path

    def _abandon_after(self, step: int, why: str, keep: Path | None = None) -> None:
        """Later checkpoints of this run belong to another timeline: rename them so auto never picks them."""
        for later in mf.committed(self.root):
            if int(later.name.split("-")[1]) > step and (keep is None or later.resolve() != keep.resolve()):
                target = later.with_name(f"{later.name}.abandoned-{self.session}")
                later.rename(target)
                logger.warning("meshrun: %s: renamed the checkpoint %s to %s so that restarts never return to it",
                               why, later.name, target.name)

    def _latest_valid(self) -> Path | None:
        for candidate in mf.committed(self.root):
            bad = mf.problem(candidate)
            if bad is None:
                return candidate
            logger.warning("meshrun: skipping damaged checkpoint %s: %s", candidate.name, bad)
        return None

    def _drop_uncommitted(self) -> None:
        for tmp in mf.uncommitted(self.root):
            logger.warning("meshrun: ignoring incomplete checkpoint %s (the write never committed); removing it",
                           tmp.name)
            shutil.rmtree(tmp, ignore_errors=True)

    def _load(self, path: Path, state: TrainState) -> None:
        saved = torch.load(path / mf.TRAIN_STATE, weights_only=True)
        tensors = tensor_state(state)
        check_fits(path, tensors["model"])
        dcp.load(tensors, checkpoint_id=str(path))
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
        signum = self._agreed_signal()
        if signum:
            self.save(state, blocking=True)
            if self.env.is_main:
                (self.root / PREEMPTED_FILE).write_text(json.dumps(
                    {"step": state.step, "signal": signal.Signals(signum).name, "session": self.session}))
            raise Preempted(state.step, signum)
        if self.cfg.interval and state.step % self.cfg.interval == 0:
            self.save(state, blocking=not self.cfg.async_save)

    def finish(self, state: TrainState) -> None:
        """A last checkpoint at the final step (when checkpoints are on); waits for any background write."""
        if self.cfg.interval and self._last_saved != state.step:
            self.save(state, blocking=True)
        self._wait()
        self.close()

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers = {}

    def save(self, state: TrainState, *, blocking: bool = True) -> None:
        self._wait()  # one write at a time
        if self._last_saved == state.step:
            return
        tmp = self.root / f"{mf.step_dir_name(state.step)}.tmp-{self.session}"
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank-{self.env.rank:05d}.pt")
        if self.env.is_main:
            torch.save(train_state(state, layout=self.layout, config_toml=self.config_toml), tmp / mf.TRAIN_STATE)
        _maybe_fault(state.step, self.env)
        tensors = tensor_state(state)
        self._last_saved = state.step
        if blocking:
            dcp.save(tensors, checkpoint_id=str(tmp))
            self._commit(tmp, state.step)
        else:
            if self._async_group is None and dist.get_world_size() > 1:
                # DCP's collectives run in a background thread: give them their own group, never
                # interleaved with the training's collectives on the default one.
                self._async_group = dist.new_group(backend="gloo")
            if self._stager is None:  # kept across saves: its CPU copies are reused, only memcpy blocks
                self._stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                            use_shared_memory=False, use_async_staging=False,
                                                            use_non_blocking_copy=False))
            future = dcp.async_save(tensors, checkpoint_id=str(tmp), process_group=self._async_group,
                                    async_stager=self._stager)
            self._pending = (getattr(future, "upload_completion", future), tmp, state.step)

    def _poll(self) -> None:
        if self._pending is not None and self._pending[0].done():
            self._wait()

    def _wait(self) -> None:
        if self._pending is None:
            return
        future, tmp, step = self._pending
        self._pending = None
        future.result()
        self._commit(tmp, step)

    def _commit(self, tmp: Path, step: int) -> None:
        """Rank 0, after every rank has written: manifest, atomic rename, `latest`, keep the last K."""
        if not self.env.is_main:
            return
        final = self.root / mf.step_dir_name(step)
        mf.write_manifest(tmp, step=step, layout=self.layout, session=self.session, time=time.time())
        if final.exists():
            shutil.rmtree(final)  # the same step saved again (a redone step after a restart)
        os.replace(tmp, final)
        mf.write_latest(self.root, final.name)
        for old in mf.committed(self.root)[self.cfg.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("meshrun: checkpoint %s committed", final)

    # -- preemption ----------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:  # noqa: ANN001 - signal handler signature
        if self._signal and time.monotonic() - self._signal_at > 1.0:  # asked again, later: stop now
            raise KeyboardInterrupt
        if not self._signal:
            self._signal, self._signal_at = signum, time.monotonic()

    def _agreed_signal(self) -> int:
        """The signal any rank got, agreed by every rank at the same step (a small all_reduce)."""
        if self.env.world_size == 1:
            return self._signal
        flag = torch.tensor([self._signal], dtype=torch.int64, device=self.env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def _broadcast(value):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _describe(layout: dict) -> str:
    degrees = ", ".join(f"{k} {v}" for k, v in layout.items() if k not in ("world_size", "strategy") and v != 1)
    return f"{layout.get('world_size')} processes, {layout.get('strategy')}" + (f" ({degrees})" if degrees else "")


def _maybe_fault(step: int, env: DistEnv) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if (spec == f"ckpt_write:{step}" and env.rank == env.world_size - 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)


def preempted_exit_code(run_dir: Path, signum: int, *, since: float) -> int:
    """The agent's exit code after SIGTERM/SIGINT: 0 when the workers committed a checkpoint since `since`.

    Otherwise 128 + the signal number (143 for SIGTERM), the shell's convention for "killed by
    a signal", which schedulers treat as preempted. Either way re-running the command resumes.
    """
    name = signal.Signals(signum).name
    marker = mf.checkpoints_dir(run_dir) / PREEMPTED_FILE
    try:
        if marker.stat().st_mtime >= since:
            step = json.loads(marker.read_text())["step"]
            print(f"meshrun train: stopped by {name} at step {step}, checkpoint committed; "
                  "re-run the same command to continue", file=sys.stderr)
            return 0
    except (OSError, ValueError, KeyError):
        pass
    print(f"meshrun train: stopped by {name} before a checkpoint was committed; re-running the same "
          "command continues from the latest valid checkpoint", file=sys.stderr)
    return 128 + signum
