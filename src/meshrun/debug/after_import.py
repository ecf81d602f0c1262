"""Run a callback right after a script first imports torch, and never before it (stdlib only).

The launch bootstrap uses it so that a script's first line waits for no torch import, while
meshrun's hooks (the hang watchdog, rank 0's loopback store) are in place before the script's
first torch call.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


class AfterImport(importlib.abc.MetaPathFinder):
    """A meta path finder that calls `then()` right after `torch` (with torch.distributed) is imported."""

    def __init__(self, then: Callable[[], None]) -> None:
        self.then = then

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 - finder protocol
        if name != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module):  # noqa: ANN001
            exec_module(module)
            self.then()

        spec.loader.exec_module = exec_then
        return spec


def after_torch_import(then: Callable[[], None]) -> None:
    """`then()` now if torch is imported, else right after the first `import torch`."""
    if "torch" in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, AfterImport(then))
