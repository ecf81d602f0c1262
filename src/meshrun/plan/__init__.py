"""`meshrun plan`: per-rank memory of candidate parallel layouts, and where each parameter lives.

    meshrun plan --model small --world 8 --device-memory 16
    meshrun plan --show examples/configs/tiny.toml --world 4 --set parallel.tp=2
"""

from __future__ import annotations

from meshrun.plan.activations import activation_bytes
from meshrun.plan.memory import (
    MemoryEstimate,
    Plan,
    candidates,
    estimate,
    layouts,
    rank_key,
    state_bytes,
)
from meshrun.plan.show import ParamPlacement, format_show, local_shapes, param_shapes, placements

__all__ = [
    "MemoryEstimate",
    "ParamPlacement",
    "Plan",
    "activation_bytes",
    "candidates",
    "estimate",
    "format_show",
    "layouts",
    "local_shapes",
    "param_shapes",
    "placements",
    "rank_key",
    "state_bytes",
]
