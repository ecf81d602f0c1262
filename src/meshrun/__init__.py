"""meshrun: launch, train, checkpoint and debug distributed PyTorch, on CPU (gloo) or GPU (NCCL).

Worker scripts call::

    import meshrun
    env = meshrun.init()          # reads torchrun's env, picks device and backend
    ...
    meshrun.shutdown()            # optional: also runs at exit, cleanly

and are started with ``meshrun launch --nproc-per-node 4 script.py``.
Imports are lazy so that ``meshrun launch`` workers start as fast as under torchrun, and importing
meshrun changes nothing in the process: no hook, no patch, no thread. What meshrun installs,
``meshrun.init()`` installs and ``meshrun.shutdown()`` removes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "DistEnv", "Runtime", "MeshrunError", "init", "shutdown", "current", "print0",
    "prepare", "prepare_model", "prepare_dataloader", "__version__",
    "heartbeat", "phase", "check_dataloader", "check_optimizer",
]

if TYPE_CHECKING:
    from meshrun.api import prepare, prepare_dataloader, prepare_model
    from meshrun.debug.data_check import check_dataloader
    from meshrun.debug.optim_check import check_optimizer
    from meshrun.errors import MeshrunError
    from meshrun.runtime.process import DistEnv, Runtime, heartbeat, phase
    from meshrun.runtime.session import current, init, print0, shutdown

_LAZY = {
    "DistEnv": "meshrun.runtime.process",
    "Runtime": "meshrun.runtime.process",
    "init": "meshrun.runtime.session",
    "shutdown": "meshrun.runtime.session",
    "current": "meshrun.runtime.session",
    "print0": "meshrun.runtime.session",
    "MeshrunError": "meshrun.errors",
    "prepare": "meshrun.api",
    "prepare_model": "meshrun.api",
    "prepare_dataloader": "meshrun.api",
    "heartbeat": "meshrun.runtime.process",
    "phase": "meshrun.runtime.process",
    "check_dataloader": "meshrun.debug.data_check",
    "check_optimizer": "meshrun.debug.optim_check",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshrun' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
