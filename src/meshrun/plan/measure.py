"""Measure what `meshrun plan` estimates: activation memory, and the bytes context parallel's ring moves.

    with SavedActivations(model.parameters) as acts:
        loss_fn(model(x), y).backward()
    print(acts.peak)

`ReceivedBytes` counts the bytes this rank receives in the functional collectives run under it
(`torch.ops._c10d_functional`: the ring of meshrun.parallel.context; FSDP and DDP call the process
group directly and are not seen), checked against `meshrun.plan.ring`.

CPU has no allocator counter and RSS is dominated by torch itself, so `meshrun plan`'s activation
estimate is checked against this instead. Every tensor autograd saves in forward goes through
`torch.autograd.graph.saved_tensors_hooks`; it is counted by its storage (so views and tensors
saved by several ops count once, DTensors by their local shard) until autograd releases it
(after its backward node ran, or when the graph is freed). Storages of the parameters (whatever
the module holds at that moment: FSDP2's unsharded ones during forward) and buffers are left
out: they are state, not activations. `peak` is the most bytes held at once, so a pipeline
schedule's in-flight micro-batches are what it sees (GPipe: all; 1F1B: fewer).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding the bytes: a DTensor's local shard; the buffer inside the
    AsyncCollectiveTensor that TP's all-reduced outputs are (functional collectives)."""
    while True:
        inner = getattr(t, "_local_tensor", None)
        inner = getattr(t, "elem", None) if inner is None else inner
        if not isinstance(inner, torch.Tensor):
            return t
        t = inner


class _Saved:
    """What autograd keeps in place of the tensor; its death tells us autograd released it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedActivations:
    """Context manager: `peak` (bytes) of distinct non-parameter storages saved for backward."""

    def __init__(self, state: Callable[[], Iterable[torch.Tensor]]):
        """`state()` returns the parameters and buffers now held (called at each save)."""
        self._state = state
        self._live: dict[int, list[int]] = {}  # storage ptr -> [nbytes, references]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved.tensor)

    def _pack(self, t: torch.Tensor):
        storage = _local(t).untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in {_local(s).untyped_storage().data_ptr() for s in self._state()}:
            return _Saved(t)
        entry = self._live.setdefault(ptr, [nbytes, 0])
        if entry[1] == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, ptr)
        return saved

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[ptr]

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class ReceivedBytes(TorchDispatchMode):
    """Bytes this rank receives in the functional collectives dispatched while it is entered:
    an all-gather brings (group size - 1) inputs, an all-to-all its output splits."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        packet = getattr(func, "overloadpacket", None)
        if packet is torch.ops._c10d_functional.all_gather_into_tensor:
            tensor, group_size = args[0], args[1]
            self.bytes += tensor.numel() * tensor.element_size() * (group_size - 1)
        elif packet is torch.ops._c10d_functional.all_to_all_single:
            tensor, output_split_sizes = args[0], args[1]
            row = tensor.element_size() * (tensor[0].numel() if tensor.dim() > 1 else 1)
            self.bytes += sum(output_split_sizes) * row
        return func(*args, **(kwargs or {}))
