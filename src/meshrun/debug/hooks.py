"""Where the debug machinery joins a worker, and where it leaves: torch's import, init, shutdown.

`meshrun launch` runs every worker through launch/worker_main.py, which calls
`install_import_hook()` when the launcher asked for the hang watchdog or `--debug collectives`:
the collectives are then wrapped as soon as the user's script imports torch (scripts that never
do pay nothing). `meshrun.init()` calls `attach(runtime)`, `collective_timeout()` and
`after_init()`; `meshrun.shutdown()`, or the exit of a script that never calls it, calls
`shutdown()`, which takes everything back: torch's own collectives, no global optimizer hooks,
no import finder, no atexit entry. Nothing is installed unless this is a `meshrun launch` worker
with MESHRUN_HANG_TIMEOUT > 0 or MESHRUN_DEBUG set.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import replace
from datetime import timedelta
from typing import Protocol

from meshrun.debug.after_import import AfterImport
from meshrun.debug.collectives import CollectivePatch
from meshrun.debug.heartbeat import Heartbeat
from meshrun.debug.settings import MIN_HANG_TIMEOUT_S, DebugSettings, check_collective_timeout


class DebugHooks:
    """The hang watchdog and `--debug collectives` of one worker: what is installed, and its undoing."""

    def __init__(self, settings: DebugSettings, heartbeat: Heartbeat) -> None:
        self.settings = settings
        self.heartbeat = heartbeat
        self.collectives: CollectivePatch | None = None
        self.watchdog = None
        self._finder: AfterImport | None = None
        self._handles: list = []  # torch's RemovableHandles of the global optimizer step hooks
        self._at_exit = False

    @property
    def enabled(self) -> bool:
        return self.settings.hang_timeout_s > 0 or self.settings.collectives

    @property
    def installed(self) -> bool:
        return self.collectives is not None

    def install_import_hook(self) -> None:
        """Install the collective wrappers when torch is imported (now if it already is)."""
        if not self.enabled:
            return
        if "torch" in sys.modules:
            self.install()
        elif self._finder is None:
            self._finder = AfterImport(self.install)
            sys.meta_path.insert(0, self._finder)
            self._exit_with_process()

    def install(self) -> None:
        """Wrap collectives, count optimizer steps as progress, start the watchdog."""
        if self.collectives is not None or not self.enabled:
            return
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        from meshrun.debug.optim_check import first_step_check

        self.collectives = CollectivePatch(self.heartbeat)
        self.collectives.install(self._make_checker if self.settings.collectives else None)
        self.collectives.on_leave(self.before_shutdown)  # the script's own destroy_process_group()
        self.start_watchdog()  # now, not at the first collective: a rank that never gets there is a hang too
        progress = self.heartbeat
        self._handles = [
            register_optimizer_step_post_hook(lambda *_: progress.step()),
            register_optimizer_step_pre_hook(first_step_check),  # FSDP2: optimizer built before fully_shard
        ]
        self._exit_with_process()

    def _exit_with_process(self) -> None:
        if not self._at_exit:
            atexit.register(self._shutdown_at_exit)
            self._at_exit = True

    def _shutdown_at_exit(self) -> None:
        self._at_exit = False  # running from atexit: nothing to unregister
        self.shutdown()

    def _make_checker(self):
        from meshrun.debug.fingerprint import Checker
        from meshrun.debug.store import connect

        store = connect()
        rank, world = _rank_world()
        if store is None or world < 2:
            return None
        hang = self.settings.hang_timeout_s
        return Checker(store, rank, world, arrival_timeout_s=hang if hang > 0 else 60.0)

    def start_watchdog(self) -> None:
        """Start the hang watchdog once, when the job has more than one rank."""
        hang = self.settings.hang_timeout_s
        rank, world = _rank_world()
        if self.watchdog is not None or hang <= 0 or world < 2:
            return
        from meshrun.debug.store import connect
        from meshrun.debug.watchdog import Watchdog

        skip = self.collectives.skip_dirs if self.collectives is not None else ()
        self.watchdog = Watchdog(hang, rank, world, connect, skip, self.heartbeat, explicit=self.settings.explicit)
        self.watchdog.start()

    def collective_timeout(self, timeout: timedelta | None) -> timedelta | None:
        """The timeout for init_process_group: the user's (checked against the watchdog's) or 2 x hang.

        A --hang-timeout the user chose must be below their collective timeout (else refused); the
        default one shortens itself to half of a shorter user timeout instead.
        """
        if not self.enabled:
            return timeout
        s = self.settings
        plan = s.plan
        if timeout is None:
            return timedelta(seconds=plan.collective_s) if plan.collective_s else None
        seconds = timeout.total_seconds()
        if s.explicit:
            check_collective_timeout(seconds, plan.watchdog_s)
        elif plan.watchdog_s >= seconds:
            half = seconds / 2
            self.settings = replace(s, hang_timeout_s=half if half >= MIN_HANG_TIMEOUT_S else 0.0)
            if self.watchdog is not None:  # started when torch was imported, with the longer timeout
                if self.settings.hang_timeout_s > 0:
                    self.watchdog.timeout_s = self.settings.hang_timeout_s
                else:
                    self.watchdog.stopped.set()
                    self.watchdog = None
        return timeout

    def after_init(self) -> None:
        """Called by meshrun.init(): make sure the wrappers are in and the watchdog runs."""
        if not self.enabled:
            return
        self.install()
        self.start_watchdog()

    def before_shutdown(self) -> None:
        """This rank has made its last collective: tell fingerprint peers, stop watching for hangs."""
        checker = self.collectives.checker if self.collectives is not None else None
        if checker is not None and not self.heartbeat.job_ending.is_set():  # else nobody waits for it
            checker.mark_done()
            self.collectives.checker = None  # once: destroy_process_group(), then exit, both come here
        if self.watchdog is not None:
            self.watchdog.leave()
            self.watchdog = None

    def shutdown(self) -> None:
        """`before_shutdown()`, then take back every wrapper and hook (idempotent)."""
        self.before_shutdown()
        if self.collectives is not None:
            self.collectives.uninstall()
            self.collectives = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None
        if self._at_exit:
            atexit.unregister(self._shutdown_at_exit)
            self._at_exit = False


class HooksHolder(Protocol):
    """What the hooks hang on: the process's one Runtime (meshrun.runtime.process), passed down."""

    debug: DebugHooks | None
    heartbeat: Heartbeat


def attach(runtime: HooksHolder) -> DebugHooks:
    """The runtime's DebugHooks, made from the environment's settings on first use."""
    if runtime.debug is None:
        runtime.debug = DebugHooks(DebugSettings.from_env(), runtime.heartbeat)
    return runtime.debug


def install_import_hook(runtime: HooksHolder) -> None:
    """The launch bootstrap's entry: wrap collectives once the user's script imports torch."""
    attach(runtime).install_import_hook()


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
