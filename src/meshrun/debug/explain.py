"""Explanations for torch errors the guide's table warns about, keyed on torch's own words.

Standard library only: the launch bootstrap (launch/worker_main.py) calls `explain(exc)` on
every failure and prints the line after the traceback and into error.json.
"""

from __future__ import annotations

import re

_RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"device_ids and output_device arguments only work with.*module parameters \{device\(type='cpu'"),
     "DDP was given device_ids for a module on the CPU: on CPU leave them out, "
     "DDP(model) (or DDP(model, device_ids=env.device_ids), which is None on CPU; meshrun.prepare_model does this)"),
    (re.compile(r"device_ids and output_device arguments only work with"),
     "DDP was given device_ids for a module that spans several devices (model parallel): leave device_ids "
     "and output_device out, DDP(model); pass device_ids=[local_rank] only for a module on one GPU"),
    (re.compile(r"device_ids can only be None or contain a single element"),
     "DDP takes one device per process: DDP(model, device_ids=[local_rank]) (env.device_ids from meshrun.init()), "
     "and start one process per GPU with meshrun launch"),
    (re.compile(r"got mixed torch\.Tensor and DTensor"),
     "a module sharded with fully_shard was called as model.forward(x), which skips FSDP's all-gather of the "
     "parameters: call model(x) instead (or, for another method, register it with "
     "torch.distributed.fsdp.register_fsdp_forward_method)"),
]


def explain(exc_type: str, text: str) -> str | None:
    """One line saying what went wrong and the right call, or None when meshrun knows nothing better."""
    for pattern, line in _RULES:
        if pattern.search(f"{exc_type}: {text}"):
            return line
    return None
