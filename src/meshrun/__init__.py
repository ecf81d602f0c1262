"""meshrun: launch, train, checkpoint and debug distributed PyTorch, on CPU (gloo) or GPU (NCCL).

Worker scripts call::

    import meshrun
    env = meshrun.init()          # reads torchrun's env, picks device and backend
    ...
    meshrun.shutdown()            # optional: also runs at exit, cleanly

and are started with ``meshrun launch --nproc-per-node 4 script.py``.
Imports are lazy so that ``meshrun launch`` workers start as fast as under torchrun.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshrun.launch.plain_python import install_excepthook as _install_excepthook

__version__ = "0.1.0"

_install_excepthook()  # plain `python train.py` on a torchrun-style script: end with the launch command

__all__ = [
    "DistEnv", "MeshrunError", "init", "shutdown", "current", "print0",
    "prepare", "prepare_model", "prepare_dataloader", "__version__",
    "heartbeat", "check_dataloader", "check_optimizer",
]

if TYPE_CHECKING:
    from meshrun.api import prepare, prepare_dataloader, prepare_model
    from meshrun.debug.data_check import check_dataloader
    from meshrun.debug.optim_check import check_optimizer
    from meshrun.debug.progress import heartbeat
    from meshrun.errors import MeshrunError
    from meshrun.runtime.session import DistEnv, current, init, print0, shutdown

_LAZY = {
    "DistEnv": "meshrun.runtime.session",
    "init": "meshrun.runtime.session",
    "shutdown": "meshrun.runtime.session",
    "current": "meshrun.runtime.session",
    "print0": "meshrun.runtime.session",
    "MeshrunError": "meshrun.errors",
    "prepare": "meshrun.api",
    "prepare_model": "meshrun.api",
    "prepare_dataloader": "meshrun.api",
    "heartbeat": "meshrun.debug.progress",
    "check_dataloader": "meshrun.debug.data_check",
    "check_optimizer": "meshrun.debug.optim_check",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshrun' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
