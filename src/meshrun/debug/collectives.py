"""Wrap torch.distributed's collective functions: record each call, optionally fingerprint it.

Recording (always, while the hang watchdog is on) keeps this rank's last collectives with the
user's file:line for the hang report, and counts a returned collective as progress. With
`--debug collectives` each call is also checked against every peer's (fingerprint.py) before
it runs. Collectives issued from C++ (DDP's reducer) or through functional collectives
(DTensor) are not seen here; torch's TORCH_DISTRIBUTED_DEBUG=DETAIL covers them without call
sites, but meshrun does not set it: with DDP on torch 2.13 CPU it segfaults.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

from meshrun.debug import progress

# op -> (position, keyword) of the tensor whose dtype and shape every rank must agree on;
# None: nothing comparable (objects, per-rank split sizes).
OPS: dict[str, tuple[int, str] | None] = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "reduce": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "reduce_scatter": (0, "output"),
    "gather": (0, "tensor"),
    "scatter": (0, "tensor"),
    "all_to_all_single": None,
    "all_to_all": None,
    "barrier": None,
    "monitored_barrier": None,
    "all_gather_object": None,
    "broadcast_object_list": None,
    "gather_object": None,
    "scatter_object_list": None,
}

# op -> position of its `group` argument
GROUP_POS = {
    "all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2, "all_to_all": 2,
    "all_gather_object": 2, "broadcast_object_list": 2, "reduce_scatter_tensor": 3, "reduce_scatter": 3,
    "reduce": 3, "gather": 3, "scatter": 3, "gather_object": 3, "scatter_object_list": 3,
    "all_to_all_single": 4, "barrier": 0, "monitored_barrier": 0,
}

_tls = threading.local()
_seqs: dict[str, int] = {}
_checker = None  # a fingerprint.Checker when --debug collectives
_installed = False
_skip_dirs: tuple[str, ...] = ()
_fallback_skip: tuple[str, ...] = ()


def call_site(depth: int = 2) -> str:
    """`file:line in function` of the first frame outside torch and meshrun (else outside torch)."""
    frame = sys._getframe(depth)
    fallback = None
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_skip_dirs) and not path.startswith("<"):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        if fallback is None and not path.startswith(_fallback_skip) and not path.startswith("<"):
            fallback = f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return fallback or "<unknown>"


def _describe_tensor(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return f"{len(value)}x{_describe_tensor(value[0])}"
    return "-"


def _group_name(group) -> str:
    if group is None:
        return "world"
    name = getattr(group, "group_name", None)
    return "world" if name in (None, "", "0") else str(name)


def _wrap(op: str, fn):
    where = OPS[op]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_tls, "inside", False):  # e.g. all_gather_object -> all_gather: count the outer one
            return fn(*args, **kwargs)
        _tls.inside = True
        try:
            group = kwargs.get("group")
            if group is None and len(args) > GROUP_POS[op]:
                group = args[GROUP_POS[op]]
            gname = _group_name(group)
            seq = _seqs.get(gname, 0) + 1
            _seqs[gname] = seq
            tensor = "-"
            if where is not None:
                pos, name = where
                value = kwargs[name] if name in kwargs else (args[pos] if len(args) > pos else None)
                tensor = _describe_tensor(value)
            record = progress.CollectiveRecord(seq, op, gname, tensor, call_site())
            progress.begin(record)
            _on_first_collective()
            if _checker is not None:
                _checker.check(record, group)
            result = fn(*args, **kwargs)
            progress.end(record)
            return result
        finally:
            _tls.inside = False

    wrapper.__meshrun_wrapped__ = fn
    return wrapper


_first_hooks: list = []


def on_first_collective(callback) -> None:
    """Run `callback()` once, at the first recorded collective (the group exists by then)."""
    _first_hooks.append(callback)


def _on_first_collective() -> None:
    while _first_hooks:
        _first_hooks.pop(0)()


def install(checker_factory=None) -> None:
    """Wrap the collectives in torch.distributed and its distributed_c10d module (idempotent)."""
    global _installed, _skip_dirs, _fallback_skip, _checker
    if checker_factory is not None and _checker is None:
        on_first_collective(lambda: _set_checker(checker_factory()))
    if _installed:
        return
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import meshrun

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    _fallback_skip = (torch_dir,)
    _skip_dirs = (torch_dir, os.path.dirname(meshrun.__file__) + os.sep)
    for op in OPS:
        original = getattr(c10d, op, None)
        if original is None or hasattr(original, "__meshrun_wrapped__"):
            continue
        wrapped = _wrap(op, original)
        setattr(c10d, op, wrapped)
        if getattr(dist, op, None) is original:
            setattr(dist, op, wrapped)
    _installed = True


def _set_checker(checker) -> None:
    global _checker
    _checker = checker


def checker():
    return _checker


def skip_dirs() -> tuple[str, ...]:
    """Directories whose frames are not the user's (torch, meshrun)."""
    return _skip_dirs
