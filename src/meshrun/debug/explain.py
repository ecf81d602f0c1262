"""Explanations for torch errors the guide's table warns about, keyed on torch's own words.

Standard library only: the launch bootstrap (launch/worker_main.py) calls `explain_exception(exc)`
on every failure and prints the line after the traceback and into error.json.

Some of torch's words have several causes: `got mixed torch.Tensor and DTensor` comes from an
optimizer over sharded and plain tensors as often as from `model.forward(x)` on a sharded module.
The frames of the traceback tell which; a fix is given only for the cause they show, and without
them the line names the common causes without picking one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Protocol


class Frame(Protocol):
    """What explain reads of a traceback frame (traceback.FrameSummary has it)."""

    filename: str
    name: str
    line: str | None


_DIRECT_FORWARD = re.compile(r"(?<!super\(\))\.forward\(")
_OPTIMIZER_FILE = re.compile(r"[/\\]torch[/\\](?:distributed[/\\])?optim[/\\]")
_OPTIMIZER_FUNCTION = re.compile(r"^_(?:multi_tensor|single_tensor|fused)_")
_CLIP_FILE = re.compile(r"[/\\]torch[/\\]nn[/\\]utils[/\\]clip_grad\.py$")
_TORCH_FILE = re.compile(r"[/\\]torch[/\\]")

MIXED_IN_OPTIMIZER = (
    "an optimizer param group mixes DTensor (sharded) parameters and plain tensors: build the optimizer after "
    "fully_shard/parallelize_module, from model.parameters() of the sharded model, apply fully_shard to the root "
    "module too (after its layers) so that no parameter stays a plain tensor, and add no unsharded tensors to it")
MIXED_IN_CLIP = (
    "the gradients mix DTensor (sharded) and plain tensors: some parameters are not sharded; apply fully_shard to "
    "the root module too (after its layers) so that every parameter is a DTensor, or clip the two kinds apart")
MIXED_FORWARD = (
    "a module sharded with fully_shard was called as model.forward(x), which skips FSDP's all-gather of the "
    "parameters: call model(x) instead (or, for another method, register it with "
    "torch.distributed.fsdp.register_fsdp_forward_method)")
MIXED_UNKNOWN = (
    "an operation got a DTensor (a parameter sharded by fully_shard or parallelize_module) together with a plain "
    "tensor; the common causes: a sharded module called as model.forward(x) instead of model(x), an optimizer (or "
    "clip_grad_norm_) over sharded and unsharded parameters (fully_shard the root module too, and build the "
    "optimizer after sharding), or a plain tensor combined with a sharded parameter outside forward "
    "(DTensor.from_local or .full_tensor())")


def _called_forward_directly(frames: Sequence[Frame]) -> bool:
    """Code outside torch called `.forward(` and the next frame is a forward entered without `__call__`."""
    return any(callee.name == "forward" and caller.line and _DIRECT_FORWARD.search(caller.line)
               and not _TORCH_FILE.search(caller.filename)
               for caller, callee in pairwise(frames))


def _mixed_dtensor(frames: Sequence[Frame] | None) -> str:
    if not frames:
        return MIXED_UNKNOWN
    if any(_OPTIMIZER_FILE.search(f.filename) or _OPTIMIZER_FUNCTION.match(f.name) for f in frames):
        return MIXED_IN_OPTIMIZER
    if any(_CLIP_FILE.search(f.filename) for f in frames):
        return MIXED_IN_CLIP
    if _called_forward_directly(frames):
        return MIXED_FORWARD
    return MIXED_UNKNOWN


_RULES: list[tuple[re.Pattern, str | Callable[[Sequence[Frame] | None], str]]] = [
    (re.compile(r"device_ids and output_device arguments only work with.*module parameters \{device\(type='cpu'"),
     "DDP was given device_ids for a module on the CPU: on CPU leave them out, "
     "DDP(model) (or DDP(model, device_ids=env.device_ids), which is None on CPU; meshrun.prepare_model does this)"),
    (re.compile(r"device_ids and output_device arguments only work with"),
     "DDP was given device_ids for a module that spans several devices (model parallel): leave device_ids "
     "and output_device out, DDP(model); pass device_ids=[local_rank] only for a module on one GPU"),
    (re.compile(r"device_ids can only be None or contain a single element"),
     "DDP takes one device per process: DDP(model, device_ids=[local_rank]) (env.device_ids from meshrun.init()), "
     "and start one process per GPU with meshrun launch"),
    (re.compile(r"got mixed torch\.Tensor and DTensor"), _mixed_dtensor),
]


def explain(exc_type: str, text: str, frames: Sequence[Frame] | None = None) -> str | None:
    """One line saying what went wrong and the right call, or None when meshrun knows nothing better.

    `frames`: the traceback, outermost first (traceback.extract_tb), where one cause of several is
    told by where the error was raised; without them such an error gets its common causes.
    """
    for pattern, line in _RULES:
        if pattern.search(f"{exc_type}: {text}"):
            return line(frames) if callable(line) else line
    return None


def explain_exception(exc: BaseException) -> str | None:
    """explain() for a caught exception, with its traceback's frames."""
    import traceback

    return explain(type(exc).__name__, str(exc), traceback.extract_tb(exc.__traceback__))
