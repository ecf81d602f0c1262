"""Training metrics: the jsonl/TensorBoard sink, rank 0's progress bar, memory, MFU and step timing."""

from __future__ import annotations

from typing import Any

from meshrun.metrics.logger import METRICS_FILE, RANKS_DIR, MetricsLogger, rank_file
from meshrun.metrics.progress import ProgressBar

# torch-backed names load on first use: `meshrun report` reads metrics files without torch.
_SYSTEM = ("StepTimer", "StepTiming", "device_peak_flops", "mfu", "peak_flops_for_name", "peak_memory_bytes",
           "peak_memory_kind", "transformer_flops_per_token")


def __getattr__(name: str) -> Any:
    if name in _SYSTEM:
        from meshrun.metrics import system

        return getattr(system, name)
    raise AttributeError(f"module 'meshrun.metrics' has no attribute {name!r}")


__all__ = [
    "METRICS_FILE",
    "RANKS_DIR",
    "MetricsLogger",
    "ProgressBar",
    "StepTimer",
    "StepTiming",
    "device_peak_flops",
    "mfu",
    "peak_flops_for_name",
    "peak_memory_bytes",
    "peak_memory_kind",
    "rank_file",
    "transformer_flops_per_token",
]
