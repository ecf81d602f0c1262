"""`meshrun.init()` / `meshrun.shutdown()`: one process group per worker, torn down cleanly.

    env = meshrun.init()            # under `meshrun launch`, torchrun, or plain `python`
    model = DDP(model.to(env.device), device_ids=env.device_ids)

`init()` returns the process's Runtime (runtime/process.py) and installs what the process needs
while it runs: an excepthook that marks a failing rank (and, under plain `python`, ends a
missing-launcher-variable traceback with the `meshrun launch` command), an atexit teardown, and
the debug tools the launcher asked for. `shutdown()` takes all of it back.

Teardown is the order that stops gloo's abort at exit (`terminate called without an active
exception`, in about half of 4-process DDP runs on torch 2.13 CPU when left to the interpreter):
free the user's objects (gc), meet at a barrier so no rank tears down a connection a peer still
uses, then destroy the group.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshrun.debug import hooks as debug_hooks
from meshrun.errors import MeshrunError, WorldSizeError
from meshrun.runtime import process
from meshrun.runtime.device import pick_backend, pick_device
from meshrun.runtime.env import LaunchEnv, read_launch_env
from meshrun.runtime.process import DistEnv, Runtime
from meshrun.runtime.store import rank0_store

__all__ = ["DistEnv", "Runtime", "current", "init", "mark_failed", "print0", "shutdown"]

logger = logging.getLogger(__name__)

# Bounded so a peer that hangs instead of exiting cannot stall teardown for the 30-minute default;
# generous enough for rank 0 to finish writing a final checkpoint while the others wait.
SHUTDOWN_BARRIER_TIMEOUT_S = 30.0


def _as_timedelta(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if timeout <= 0:
        raise MeshrunError(f"meshrun.init(timeout={timeout!r}): must be > 0 seconds")
    return timedelta(seconds=float(timeout))


def init(
    *,
    backend: str | None = None,
    device: str | None = None,
    timeout: float | timedelta | None = None,
    min_world_size: int = 1,
) -> Runtime:
    """Join the job's process group (idempotent) and return this process's Runtime.

    backend: override the choice (nccl on GPUs, gloo on CPU). device: e.g. "cpu" to stay
    off accelerators. timeout: seconds for collectives (torch's default when None).
    min_world_size: refuse to run with fewer processes, with the exact command to use.

    The Runtime reads like the job's DistEnv (`env.rank`, `env.device`, `env.device_ids`, ...).
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
) -> Runtime:
    runtime = process.get()
    if runtime.joined:
        _check_world(runtime.world_size, min_world_size, launched=True)
        return runtime
    launch = read_launch_env()
    _check_world(launch.world_size, min_world_size, launched=launch.launched)
    dev = pick_device(launch.local_rank, device)
    chosen = pick_backend(dev, backend)
    debug = debug_hooks.attach(runtime)
    if dist.is_initialized():
        # The user (or a framework) made the group; adopt it, leave its teardown to them.
        chosen = dist.get_backend()
    else:
        _create_group(chosen, dev, debug.collective_timeout(_as_timedelta(timeout)), launch)
        runtime.owns_group = True
    local_world = launch.local_world_size if launch.launched else 1
    runtime.dist_env = DistEnv(dist.get_rank(), launch.local_rank, dist.get_world_size(), local_world, dev, chosen)
    runtime.launched, runtime.joined = launch.launched, True
    _install_process_hooks(runtime)
    debug.after_init()  # hang watchdog, --debug collectives (when meshrun launch asked)
    return runtime


def _check_world(world_size: int, min_world_size: int, *, launched: bool) -> None:
    if world_size >= min_world_size:
        return
    from meshrun.runtime.plain_python import launch_command

    how = "with plain python" if not launched else f"with {world_size} process(es)"
    raise WorldSizeError(
        f"this script needs at least {min_world_size} processes but was started {how}; "
        f"run: {launch_command(nproc=min_world_size)}"
    )


def _create_group(backend: str, dev: torch.device, timeout: timedelta | None, launch: LaunchEnv) -> None:
    if launch.launched:
        # env:// reads MASTER_ADDR/PORT, RANK, WORLD_SIZE (and torchelastic's shared store).
        device_id = None if dev.type == "cpu" else dev
        with rank0_store(launch):
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    from meshrun.runtime.plain_python import launch_command

    print(
        "meshrun: no launcher environment (RANK/WORLD_SIZE unset); running as a single process. "
        f"For more, run: {launch_command()}",
        file=sys.stderr,
    )
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _install_process_hooks(runtime: Runtime) -> None:
    """An excepthook and an atexit teardown for as long as the runtime is joined; undone by shutdown()."""
    previous_hook = sys.excepthook
    active = [True]

    def _on_uncaught(exc_type, exc, tb):  # noqa: ANN001 - excepthook signature
        if active[0]:
            # A failing rank must not wait at the shutdown barrier for peers that will never come.
            runtime.failed = True
        previous_hook(exc_type, exc, tb)
        if active[0] and not runtime.launched and "meshrun.cli" not in sys.modules:
            from meshrun.runtime.plain_python import plain_python_hint

            line = plain_python_hint(exc)  # e.g. os.environ["LOCAL_RANK"]: the launch command
            if line:
                print(line, file=sys.stderr)

    def _restore_hook() -> None:
        active[0] = False  # inert even if another hook was chained on top of it since
        if sys.excepthook is _on_uncaught:
            sys.excepthook = previous_hook

    def _unregister_exit() -> None:
        if not runtime.exiting:  # atexit.unregister from inside atexit is unsafe on Python 3.10.0-1
            atexit.unregister(_shutdown_at_exit)

    sys.excepthook = _on_uncaught
    atexit.register(_shutdown_at_exit)
    runtime.undo += [_unregister_exit, _restore_hook]


def _shutdown_at_exit() -> None:
    runtime = process.peek()
    if runtime is not None:
        runtime.exiting = True
        shutdown(failed=runtime.failed)


def current() -> Runtime | None:
    """The Runtime `init()` returned, or None before it (and after `shutdown()`)."""
    runtime = process.peek()
    return runtime if runtime is not None and runtime.joined else None


def mark_failed() -> None:
    """Tell shutdown this rank is failing, so it skips the barrier (used by the launch bootstrap)."""
    runtime = process.peek()
    if runtime is not None:
        runtime.failed = True


def shutdown(*, failed: bool = False, timeout: float = SHUTDOWN_BARRIER_TIMEOUT_S) -> None:
    """Tear the process group down cleanly; safe to call twice, and runs at exit by itself.

    failed=True skips the barrier: a failing rank must not wait for peers. timeout bounds the
    barrier on every rank, so a peer that hangs instead of exiting delays teardown, never blocks it.
    Everything init() installed (excepthook, atexit entry, debug wrappers and hooks) is removed.
    """
    runtime = process.peek()
    if runtime is None:
        return
    if runtime.debug is not None:
        runtime.debug.shutdown()  # peers' fingerprint checks learn this rank is done; wrappers go
    while runtime.undo:
        runtime.undo.pop()()
    owned, runtime.owns_group, runtime.joined = runtime.owns_group, False, False
    if not owned or not dist.is_initialized():
        return
    if not failed:  # a failing rank exits next: a full collection (seconds, under load) would only delay the restart
        gc.collect()  # drop DDP reducers and optimizer state that still hold the group
    if not failed and dist.get_world_size() > 1:
        _barrier_before_teardown(runtime, timeout)
    dist.destroy_process_group()


def _barrier_before_teardown(runtime: Runtime, timeout: float) -> None:
    """A store-based barrier with a deadline on every rank.

    Not a collective: an abandoned gloo barrier that timed out leaves the group unusable and
    `destroy_process_group` hangs, while a store barrier can simply be given up on.
    """
    from torch.distributed.elastic.utils.store import barrier as store_barrier

    runtime.generation += 1
    # Shared by every rank of this rendezvous round: the store's port (each round gets a fresh
    # store, launch/spec.py RELIABLE_RESTARTS). Not TORCHELASTIC_RESTART_COUNT, which differs
    # between nodes once a lost host is replaced (the survivor's count is 1, the new node's 0),
    # so each waited out the whole timeout.
    key = "meshrun/shutdown/{}/{}:{}/{}".format(
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        os.environ.get("MASTER_ADDR", ""),
        os.environ.get("MASTER_PORT", ""),
        runtime.generation,
    )
    try:
        store = dist.distributed_c10d._get_default_store()
        store_barrier(store, dist.get_world_size(), key_prefix=key, barrier_timeout=timeout)
    except Exception as exc:  # a peer died or hangs: tear down anyway; the launcher reports the peer
        first_line = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        logger.warning("meshrun: shutdown barrier incomplete (%s); destroying the group anyway", first_line)


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only (every rank may call it; no collective involved)."""
    env = current()
    if env is None or env.rank == 0:
        print(*args, **kwargs)
