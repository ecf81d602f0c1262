"""Wrap torch.distributed's collective functions: record each call, optionally fingerprint it.

The wrappers exist only between `CollectivePatch.install()` and `uninstall()` (meshrun.init() or
the launch bootstrap, and meshrun.shutdown() or exit), and only when the launcher asked for the
hang watchdog or `--debug collectives`; uninstalling puts torch's own functions back.

Recording (always, while the hang watchdog is on) keeps this rank's last collectives with the
user's file:line for the hang report, and counts a returned collective as progress. With
`--debug collectives` each call is also checked against every peer's (fingerprint.py) before
it runs, and the collectives torch issues for the user are brought in (indirect.py): DDP's
reducer buckets (through torch's own `allreduce_hook`, registered at the model's first forward)
and DTensor's functional collectives. Still unseen: a DDP built-in C++ comm hook, DDP's buffer
broadcasts and unused-parameter map (find_unused_parameters), ops inside a compiled graph
(a torch.compile'd DDP model's buckets included).
torch's TORCH_DISTRIBUTED_DEBUG=DETAIL is not used: with DDP on torch 2.13 CPU it segfaults.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager

from meshrun.debug.heartbeat import CollectiveRecord, Heartbeat

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

JOIN_OP = "init_process_group"  # not a collective, but every rank waits there for the others
LEAVE_OP = "destroy_process_group"  # this rank's last word: the watchdog and checker stop first

# op -> position of its `group` argument
GROUP_POS = {
    "all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2, "all_to_all": 2,
    "all_gather_object": 2, "broadcast_object_list": 2, "reduce_scatter_tensor": 3, "reduce_scatter": 3,
    "reduce": 3, "gather": 3, "scatter": 3, "gather_object": 3, "scatter_object_list": 3,
    "all_to_all_single": 4, "barrier": 0, "monitored_barrier": 0,
}

def _frame_site(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


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


class CollectivePatch:
    """torch.distributed's collectives wrapped for one process: per-group counts, call sites, checks."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        self.heartbeat = heartbeat
        self.checker = None  # a fingerprint.Checker when --debug collectives, from the first collective on
        self.skip_dirs: tuple[str, ...] = ()  # frames that are not the user's: torch, meshrun
        self._fallback_skip: tuple[str, ...] = ()
        self._seqs: dict[str, int] = {}
        self._tls = threading.local()
        self._first_hooks: list[Callable[[], None]] = []
        self._leave_hooks: list[Callable[[], None]] = []
        self._replaced: list[tuple[object, str, object, object]] = []  # (module, op, original, wrapper)

    @property
    def installed(self) -> bool:
        return bool(self._replaced)

    def call_site(self, depth: int = 2) -> str:
        """`file:line in function` of the first frame outside torch and meshrun (else outside torch)."""
        frame = sys._getframe(depth)
        fallback = None
        while frame is not None:
            path = frame.f_code.co_filename
            if not path.startswith(self.skip_dirs) and not path.startswith("<"):
                return _frame_site(frame)
            if fallback is None and not path.startswith(self._fallback_skip) and not path.startswith("<"):
                fallback = _frame_site(frame)
            frame = frame.f_back
        return fallback or "<unknown>"

    def on_first_collective(self, callback: Callable[[], None]) -> None:
        """Run `callback()` once, at the first recorded collective (the group exists by then)."""
        self._first_hooks.append(callback)

    def install(self, checker_factory=None) -> None:
        """Wrap the collectives in torch.distributed and its distributed_c10d module (idempotent)."""
        if checker_factory is not None and self.checker is None:
            self.on_first_collective(lambda: setattr(self, "checker", checker_factory()))
        if self._replaced:
            return
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        torch_dir = os.path.dirname(torch.__file__) + os.sep
        meshrun_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
        self._fallback_skip = (torch_dir,)
        self.skip_dirs = (torch_dir, meshrun_dir)
        for op in (*OPS, JOIN_OP, LEAVE_OP):
            original = getattr(c10d, op, None)
            if original is None or hasattr(original, "__meshrun_wrapped__"):
                continue
            if op in (JOIN_OP, LEAVE_OP):
                wrapper = self._wrap_join(original) if op == JOIN_OP else self._wrap_leave(original)
            else:
                wrapper = self._wrap(op, original)
            for module in (c10d, dist):
                if getattr(module, op, None) is original:
                    self.replace(module, op, original, wrapper)
        if checker_factory is not None:  # only --debug collectives: DDP's buckets, DTensor's funcol
            from meshrun.debug.indirect import patch_ddp, wrap_funcol

            wrap_funcol(self)
            patch_ddp(self)

    def replace(self, owner, name: str, original, wrapper) -> None:
        """Put `wrapper` at `owner.name` until uninstall()."""
        setattr(owner, name, wrapper)
        self._replaced.append((owner, name, original, wrapper))

    @contextmanager
    def labelled(self, label: str):
        """Collectives called inside name `label` after their call site (e.g. a DDP bucket)."""
        self._tls.label = label
        try:
            yield
        finally:
            self._tls.label = None

    def uninstall(self) -> None:
        """Put torch's own functions back (where nobody has replaced the wrappers since)."""
        while self._replaced:
            module, op, original, wrapper = self._replaced.pop()
            if getattr(module, op, None) is wrapper:
                setattr(module, op, original)
        self._first_hooks.clear()
        self._leave_hooks.clear()
        self.checker = None

    def _run_first_hooks(self) -> None:
        while self._first_hooks:
            self._first_hooks.pop(0)()

    def _wrap_join(self, fn):
        """init_process_group waits for every rank: the watchdog sees a rank waiting there too.

        Recorded like a collective (so a peer that never arrives is reported), but its return is
        not progress: a job's start-up never arms the watchdog's every-stall rule.
        """
        progress = self.heartbeat

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            record = CollectiveRecord(0, JOIN_OP, "world", "-", self.call_site())
            progress.begin(record)
            try:
                return fn(*args, **kwargs)
            finally:
                progress.end(record, count=False)

        wrapper.__meshrun_wrapped__ = fn
        return wrapper

    def on_leave(self, callback: Callable[[], None]) -> None:
        """Run `callback()` when the script destroys the default group (before torch does)."""
        self._leave_hooks.append(callback)

    def _wrap_leave(self, fn):
        hooks = self._leave_hooks

        @functools.wraps(fn)
        def wrapper(group=None, *args, **kwargs):
            if group is None or _group_name(group) == "world":
                for hook in hooks:
                    hook()
            return fn(group, *args, **kwargs)

        wrapper.__meshrun_wrapped__ = fn
        return wrapper

    def _wrap(self, op: str, fn):
        return self.wrap(op, fn, where=OPS[op], group_pos=GROUP_POS[op])

    def wrap(self, op: str, fn, *, where: tuple[int, str] | None, group_pos: int, resolve_group=None):
        """`fn` recorded as `op` (and checked, with --debug collectives); its group is argument
        `group_pos` or keyword `group`, made a ProcessGroup by `resolve_group` where needed."""
        import torch

        tls, seqs, progress = self._tls, self._seqs, self.heartbeat
        compiling = torch.compiler.is_compiling

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            # e.g. all_gather_object -> all_gather: count the outer one; a traced graph runs later
            if getattr(tls, "inside", False) or compiling():
                return fn(*args, **kwargs)
            tls.inside = True
            try:
                group = kwargs.get("group")
                if group is None and len(args) > group_pos:
                    group = args[group_pos]
                if resolve_group is not None:
                    group = resolve_group(group)
                gname = _group_name(group)
                seq = seqs.get(gname, 0) + 1
                seqs[gname] = seq
                tensor = "-"
                if where is not None:
                    pos, name = where
                    value = kwargs[name] if name in kwargs else (args[pos] if len(args) > pos else None)
                    tensor = _describe_tensor(value)
                site = self.call_site()
                label = getattr(tls, "label", None)
                record = CollectiveRecord(seq, op, gname, tensor, f"{site} ({label})" if label else site)
                progress.begin(record)
                self._run_first_hooks()
                if self.checker is not None:
                    self.checker.check(record, group)
                result = fn(*args, **kwargs)
                progress.end(record)
                return result
            finally:
                tls.inside = False

        wrapper.__meshrun_wrapped__ = fn
        return wrapper
