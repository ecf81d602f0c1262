"""Distributed checkpoints through torch.distributed.checkpoint: save, commit, verify, resume, export.

The names below load on first use: `meshrun.checkpoint.manifest` (and the CLI paths that read
manifests) must not pay for the manager's torch and DCP imports.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"Checkpointer": "manager", "CheckpointError": "manifest", "Preempted": "preemption"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"meshrun.checkpoint.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'meshrun.checkpoint' has no attribute {name!r}")


__all__ = ["CheckpointError", "Checkpointer", "Preempted"]
