"""Where the debug machinery joins a worker: at torch's import, init and shutdown.

`meshrun launch` runs every worker through launch/worker_main.py, which calls
`install_import_hook()`: the collectives are wrapped as soon as the user's script imports
torch (scripts that never do pay nothing). `meshrun.init()` calls `collective_timeout()` and
`after_init()`, and `meshrun.shutdown()` calls `before_shutdown()`.
Nothing happens unless this is a `meshrun launch` worker with MESHRUN_HANG_TIMEOUT > 0 or
MESHRUN_DEBUG set.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys
from dataclasses import replace
from datetime import timedelta

from meshrun.debug import progress
from meshrun.debug.settings import MIN_HANG_TIMEOUT_S, DebugSettings, check_collective_timeout

_settings: DebugSettings | None = None
_watchdog = None
_installed = False


def settings() -> DebugSettings:
    global _settings
    if _settings is None:
        _settings = DebugSettings.from_env()
    return _settings


def _enabled() -> bool:
    s = settings()
    return s.hang_timeout_s > 0 or s.collectives


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `install()` right after `torch` (which imports torch.distributed and optim) is imported."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 - finder protocol
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):  # noqa: ANN001
            exec_module(module)
            install()

        spec.loader.exec_module = exec_then_install
        return spec


def install_import_hook() -> None:
    """Install the collective wrappers when torch is imported (now if it already is)."""
    if not _enabled():
        return
    if "torch" in sys.modules:
        install()
    else:
        sys.meta_path.insert(0, _AfterImport())


def install() -> None:
    """Wrap collectives, count optimizer steps as progress, start the watchdog at the first collective."""
    global _installed
    if _installed or not _enabled():
        return
    _installed = True
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from meshrun.debug import collectives
    from meshrun.debug.optim_check import first_step_check

    collectives.install(_make_checker if settings().collectives else None)
    collectives.on_first_collective(start_watchdog)
    register_optimizer_step_post_hook(lambda *_: progress.heartbeat())
    register_optimizer_step_pre_hook(first_step_check)  # FSDP2: optimizer built before fully_shard
    atexit.register(before_shutdown)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _make_checker():
    from meshrun.debug.fingerprint import Checker
    from meshrun.debug.store import connect

    store = connect()
    rank, world = _rank_world()
    if store is None or world < 2:
        return None
    hang = settings().hang_timeout_s
    return Checker(store, rank, world, arrival_timeout_s=hang if hang > 0 else 60.0)


def start_watchdog() -> None:
    """Start the hang watchdog once, when the job has a group of more than one rank."""
    global _watchdog
    hang = settings().hang_timeout_s
    rank, world = _rank_world()
    if _watchdog is not None or hang <= 0 or world < 2:
        return
    from meshrun.debug import collectives
    from meshrun.debug.store import connect
    from meshrun.debug.watchdog import Watchdog

    _watchdog = Watchdog(hang, rank, world, connect, collectives.skip_dirs())
    _watchdog.start()


def collective_timeout(timeout: timedelta | None) -> timedelta | None:
    """The timeout for init_process_group: the user's (checked against the watchdog's) or 2 x hang.

    A --hang-timeout the user chose must be below their collective timeout (else refused); the
    default one shortens itself to half of a shorter user timeout instead.
    """
    global _settings
    if not _enabled():
        return timeout
    s = settings()
    plan = s.plan
    if timeout is None:
        return timedelta(seconds=plan.collective_s) if plan.collective_s else None
    seconds = timeout.total_seconds()
    if s.explicit:
        check_collective_timeout(seconds, plan.watchdog_s)
    elif plan.watchdog_s >= seconds:
        half = seconds / 2
        _settings = replace(s, hang_timeout_s=half if half >= MIN_HANG_TIMEOUT_S else 0.0)
    return timeout


def after_init() -> None:
    """Called by meshrun.init(): make sure the wrappers are in and the watchdog runs."""
    if not _enabled():
        return
    install()
    start_watchdog()


def before_shutdown() -> None:
    """This rank has made its last collective: tell fingerprint peers, stop watching for hangs."""
    from meshrun.debug import collectives

    checker = collectives.checker()
    if checker is not None:
        checker.mark_done()
    if _watchdog is not None:
        _watchdog.stopped.set()
