"""`meshrun.init()` / `meshrun.shutdown()`: one process group per worker, torn down cleanly.

    env = meshrun.init()            # under `meshrun launch`, torchrun, or plain `python`
    model = DDP(model.to(env.device), device_ids=env.device_ids)

Teardown follows what field-testing showed stops gloo's abort at exit
(`terminate called without an active exception`): free the user's objects (gc), meet at a
barrier so no rank tears down a connection a peer still uses, then destroy the group.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import shlex
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshrun.debug import hooks as debug_hooks
from meshrun.errors import MeshrunError, WorldSizeError
from meshrun.runtime.device import pick_backend, pick_device
from meshrun.runtime.env import read_launch_env

logger = logging.getLogger(__name__)

# Bounded so a peer that hangs instead of exiting cannot stall teardown for the 30-minute default;
# generous enough for rank 0 to finish writing a final checkpoint while the others wait.
SHUTDOWN_BARRIER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DistEnv:
    """This worker's place in the job, fixed for the life of the process group."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_ids(self) -> list[int] | None:
        """What DDP's `device_ids` must be: `[index]` on an accelerator, None on CPU."""
        return None if self.device.type == "cpu" else [self.device.index or 0]


class _Session:
    """Per-process runtime state: the env, whether meshrun owns the group, how the process ends."""

    def __init__(self) -> None:
        self.env: DistEnv | None = None
        self.owns_group = False
        self.failed = False
        self.hooks_installed = False
        self.generation = 0  # shutdown barriers done, for unique store keys


_session = _Session()


def _as_timedelta(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if timeout <= 0:
        raise MeshrunError(f"meshrun.init(timeout={timeout!r}): must be > 0 seconds")
    return timedelta(seconds=float(timeout))


def _launch_hint(nproc: int) -> str:
    argv = sys.argv if sys.argv and sys.argv[0] else ["script.py"]
    return shlex.join(["meshrun", "launch", "--nproc-per-node", str(nproc), *argv])


def init(
    *,
    backend: str | None = None,
    device: str | None = None,
    timeout: float | timedelta | None = None,
    min_world_size: int = 1,
) -> DistEnv:
    """Join the job's process group (idempotent) and return this worker's DistEnv.

    backend: override the choice (nccl on GPUs, gloo on CPU). device: e.g. "cpu" to stay
    off accelerators. timeout: seconds for collectives (torch's default when None).
    min_world_size: refuse to run with fewer processes, with the exact command to use.

    Bad input (a malformed RANK, too few processes) ends the process with one line on
    stderr and exit code 2, not a traceback.
    """
    try:
        return _init(backend=backend, device=device, timeout=timeout, min_world_size=min_world_size)
    except MeshrunError as exc:
        print(f"meshrun: error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


def _init(
    *, backend: str | None, device: str | None, timeout: float | timedelta | None, min_world_size: int
) -> DistEnv:
    if _session.env is not None:
        _check_world(_session.env.world_size, min_world_size, launched=True)
        return _session.env
    launch = read_launch_env()
    _check_world(launch.world_size, min_world_size, launched=launch.launched)
    dev = pick_device(launch.local_rank, device)
    chosen = pick_backend(dev, backend)
    if dist.is_initialized():
        # The user (or a framework) made the group; adopt it, leave its teardown to them.
        chosen = dist.get_backend()
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        _create_group(chosen, dev, debug_hooks.collective_timeout(_as_timedelta(timeout)), launched=launch.launched)
        _session.owns_group = True
        rank, world = dist.get_rank(), dist.get_world_size()
    local_world = launch.local_world_size if launch.launched else 1
    _session.env = DistEnv(rank, launch.local_rank, world, local_world, dev, chosen)
    _install_hooks()
    debug_hooks.after_init()  # hang watchdog, --debug collectives (when meshrun launch asked)
    return _session.env


def _check_world(world_size: int, min_world_size: int, *, launched: bool) -> None:
    if world_size >= min_world_size:
        return
    how = "with plain python" if not launched else f"with {world_size} process(es)"
    raise WorldSizeError(
        f"this script needs at least {min_world_size} processes but was started {how}; "
        f"run: {_launch_hint(min_world_size)}"
    )


def _create_group(backend: str, dev: torch.device, timeout: timedelta | None, *, launched: bool) -> None:
    if launched:
        # env:// reads MASTER_ADDR/PORT, RANK, WORLD_SIZE (and torchelastic's shared store).
        device_id = None if dev.type == "cpu" else dev
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    print(
        "meshrun: no launcher environment (RANK/WORLD_SIZE unset); running as a single process. "
        "Use `meshrun launch --nproc-per-node N script.py` for more.",
        file=sys.stderr,
    )
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _install_hooks() -> None:
    if _session.hooks_installed:
        return
    _session.hooks_installed = True
    previous_hook = sys.excepthook

    def _record_failure(exc_type, exc, tb):  # noqa: ANN001 - excepthook signature
        # A failing rank must not wait at the shutdown barrier for peers that will never come.
        _session.failed = True
        previous_hook(exc_type, exc, tb)

    sys.excepthook = _record_failure
    atexit.register(_shutdown_at_exit)


def _shutdown_at_exit() -> None:
    shutdown(failed=_session.failed)


def current() -> DistEnv | None:
    """The DistEnv set by `init()`, or None before it."""
    return _session.env


def mark_failed() -> None:
    """Tell shutdown this rank is failing, so it skips the barrier (used by the launch bootstrap)."""
    _session.failed = True


def shutdown(*, failed: bool = False, timeout: float = SHUTDOWN_BARRIER_TIMEOUT_S) -> None:
    """Tear the process group down cleanly; safe to call twice, and runs at exit by itself.

    failed=True skips the barrier: a failing rank must not wait for peers. timeout bounds the
    barrier on every rank, so a peer that hangs instead of exiting delays teardown, never blocks it.
    """
    debug_hooks.before_shutdown()  # peers' fingerprint checks learn this rank is done
    owned, _session.env, _session.owns_group = _session.owns_group, None, False
    if not owned or not dist.is_initialized():
        return
    gc.collect()  # drop DDP reducers and optimizer state that still hold the group
    if not failed and dist.get_world_size() > 1:
        _barrier_before_teardown(timeout)
    dist.destroy_process_group()


def _barrier_before_teardown(timeout: float) -> None:
    """A store-based barrier with a deadline on every rank.

    Not a collective: an abandoned gloo barrier that timed out leaves the group unusable and
    `destroy_process_group` hangs, while a store barrier can simply be given up on.
    """
    from torch.distributed.elastic.utils.store import barrier as store_barrier

    _session.generation += 1
    key = "meshrun/shutdown/{}/{}/{}".format(
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        _session.generation,
    )
    try:
        store = dist.distributed_c10d._get_default_store()
        store_barrier(store, dist.get_world_size(), key_prefix=key, barrier_timeout=timeout)
    except Exception as exc:  # a peer died or hangs: tear down anyway; the launcher reports the peer
        first_line = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        logger.warning("meshrun: shutdown barrier incomplete (%s); destroying the group anyway", first_line)


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only (every rank may call it; no collective involved)."""
    env = _session.env
    if env is None or env.rank == 0:
        print(*args, **kwargs)
