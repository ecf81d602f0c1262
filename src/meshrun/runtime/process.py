"""The one object that holds this process's meshrun state; `meshrun.init()` returns it.

Nothing here runs at import. The object is made on first need: by `meshrun.init()`, or by the
`meshrun launch` bootstrap when the launcher asked for the hang watchdog or `--debug collectives`
(their state then exists before the user's script calls init, if it ever does). Everything that
meshrun installs into the process (an excepthook, collective wrappers, optimizer hooks, an atexit
handler) is recorded on it and removed by `meshrun.shutdown()`.

Standard library only: the launch bootstrap imports it before the user's script imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshrun.debug.heartbeat import Heartbeat

if TYPE_CHECKING:
    import torch

    from meshrun.debug.hooks import DebugHooks


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


class Runtime:
    """meshrun's state in this process: the job's DistEnv, the group, hooks, progress, debug tools.

    `env = meshrun.init()` is this object; `env.rank`, `env.device`, ... read its DistEnv, which
    stays readable after `meshrun.shutdown()`.
    """

    def __init__(self) -> None:
        self.dist_env: DistEnv | None = None  # set by init(); kept after shutdown
        self.joined = False  # init() done and shutdown() not yet
        self.owns_group = False  # meshrun created the process group (else the user did)
        self.launched = False  # a launcher's env (RANK/WORLD_SIZE) was present at init()
        self.failed = False  # an uncaught exception: shutdown skips the barrier
        self.exiting = False  # the interpreter is running its atexit handlers
        self.generation = 0  # shutdown barriers done, for unique store keys
        self.heartbeat = Heartbeat()  # what the hang watchdog reads
        self.debug: DebugHooks | None = None  # watchdog / --debug collectives, when the launcher asked
        self.undo: list[Any] = []  # callables that take back what init() installed, newest last

    def _env(self) -> DistEnv:
        if self.dist_env is None:
            raise RuntimeError("meshrun.init() has not run in this process")
        return self.dist_env

    @property
    def rank(self) -> int:
        return self._env().rank

    @property
    def local_rank(self) -> int:
        return self._env().local_rank

    @property
    def world_size(self) -> int:
        return self._env().world_size

    @property
    def local_world_size(self) -> int:
        return self._env().local_world_size

    @property
    def device(self) -> torch.device:
        return self._env().device

    @property
    def backend(self) -> str:
        return self._env().backend

    @property
    def is_main(self) -> bool:
        return self._env().is_main

    @property
    def device_ids(self) -> list[int] | None:
        """What DDP's `device_ids` must be: `[index]` on an accelerator, None on CPU."""
        return self._env().device_ids

    def __repr__(self) -> str:
        state = "joined" if self.joined else "not joined"
        return f"Runtime({self.dist_env!r}, {state})"


_runtime: Runtime | None = None  # the process's one Runtime, made on first need


def peek() -> Runtime | None:
    """This process's Runtime, or None when nothing has made one yet."""
    return _runtime


def get() -> Runtime:
    """This process's Runtime, made now if needed."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
    return _runtime


def heartbeat() -> None:
    """Tell the hang watchdog this rank made progress (a step, a batch, a phase); cheap, call often."""
    runtime = _runtime
    if runtime is not None:
        runtime.heartbeat.count += 1


def phase(what: str):
    """`with meshrun.phase("eval"): ...`: announce a stretch that may take longer than a training
    step (an eval, a checkpoint save, a compiled first step, loading). By default the hang
    watchdog's bound follows the step time (debug/watchdog.py); while any rank is in a phase it
    waits the long default instead. Cheap: a list append and remove."""
    return get().heartbeat.phase(what)
