"""Measure what `meshrun plan` estimates: activation memory, and the bytes context parallel's ring moves.

    with SavedActivations(model.parameters) as acts:
        loss_fn(model(x), y).backward()
    print(acts.peak)

`Collectives` records every collective run under it (kind, process group, count, bytes), and
what the functional ones (`torch.ops._c10d_functional`: context parallel's ring, TP) brought in,
which `meshrun.plan.ring` is checked against.

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


def local_bytes(tensors) -> int:
    """Bytes this rank holds of `tensors`: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


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


COLLECTIVE_KINDS = {
    # torch.ops.c10d (process-group calls: FSDP, DDP, dist.*) and torch.ops._c10d_functional
    # (functional collectives: DTensor, TP, context parallel's ring) -> one name per kind
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "send": "send", "recv_": "recv",  # point-to-point: pipeline stages' activations and gradients
}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _group_name(args) -> str:
    """The process group's name: a functional collective's `group_name` argument (its last
    string), or the name of a c10d op's ProcessGroup (boxed as a ScriptObject)."""
    import torch.distributed as dist

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg).group_name
            except (RuntimeError, TypeError):
                continue
    names = [arg for arg in args if isinstance(arg, str)]
    return names[-1] if names else ""


class Collectives(TorchDispatchMode):
    """Every collective dispatched while entered, on this rank: `records` maps (kind, process
    group name) to [count, bytes], where bytes are this rank's input buffers (an all-gather's
    shard, a reduce-scatter's or all-reduce's whole input, a send's tensor, the buffer a recv fills); `received` adds up what the
    all-gathers (group size - 1 inputs) and all-to-alls (the output splits) brought in.
    `ProcessGroup.group_name` (or a DeviceMesh dimension's group) names the group."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[tuple[str, str], list[int]] = {}
        self.received = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        packet = getattr(func, "overloadpacket", None)
        namespace = getattr(packet, "_qualified_op_name", "").split("::")[0]
        kind = COLLECTIVE_KINDS.get(getattr(packet, "__name__", "")) if namespace in ("c10d", "_c10d_functional") else None
        if kind is not None:
            self._record(namespace, kind, args)
        return func(*args, **(kwargs or {}))

    def _record(self, namespace: str, kind: str, args) -> None:
        # c10d ops take (output(s), input(s), group, ...) for gathers and scatters, and (tensors,
        # group, ...) otherwise; functional ones take the input first
        gathers = namespace == "c10d" and kind in ("all_gather", "reduce_scatter", "all_to_all")
        inputs = _tensors(args[1] if gathers else args[0])
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        entry = self.records.setdefault((kind, _group_name(args)), [0, 0])
        entry[0] += 1
        entry[1] += nbytes
        if namespace == "_c10d_functional" and kind == "all_gather":
            self.received += nbytes * (args[1] - 1)  # (input, group_size, group_name)
        elif namespace == "_c10d_functional" and kind == "all_to_all":
            tensor, output_split_sizes = args[0], args[1]
            row = tensor.element_size() * (tensor[0].numel() if tensor.dim() > 1 else 1)
            self.received += sum(output_split_sizes) * row


class _ShardingPropagation:
    """While active: `depth` > 0 inside DTensor's sharding propagation of an op it has not cached.

    That propagation runs the op once on empty tensors of the global shapes, under the fake
    tensor mode it finds active, else a fresh one, to learn the output's shape. In a real run the
    fresh mode sits above the memory tracker, which never sees those tensors; in a simulated
    rank the simulation's fake mode is found, the tracker sees them, and the first clip of
    replicated gradients counted all of them twice more (measured: +12.9% on the peak of TP 2
    with replicas; the same for every op that was not yet in DTensor's cache). DTensor serializes
    the propagation with `ShardingPropagator._fake_mode_lock`; this wraps that lock for the
    measurement and counts how deep it is entered. Where torch has no such lock, nothing is
    wrapped and the tracker counts as MemTracker does.
    """

    def __init__(self) -> None:
        self.depth = 0
        self._lock = None

    def __enter__(self):  # noqa: ANN204
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        self._lock = getattr(ShardingPropagator, "_fake_mode_lock", None)
        if self._lock is not None:
            ShardingPropagator._fake_mode_lock = _CountingLock(self, self._lock)
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        if self._lock is not None:
            ShardingPropagator._fake_mode_lock = self._lock
            self._lock = None


class _CountingLock:
    """DTensor's propagation lock, entered as before, counting its depth on `owner`."""

    def __init__(self, owner: _ShardingPropagation, lock) -> None:  # noqa: ANN001 - a lock or nullcontext
        self.owner, self.lock = owner, lock

    def __enter__(self) -> None:
        self.lock.__enter__()
        self.owner.depth += 1

    def __exit__(self, *exc) -> None:
        self.owner.depth -= 1
        self.lock.__exit__(*exc)


class PeakMemory:
    """Context manager: the most tensor bytes this process held at once over the steps run under
    it, by category, from torch's `MemTracker` (torch.distributed._tools.mem_tracker).

        prime_optimizer_state([optimizer])
        with PeakMemory(model, optimizer) as mem:
            step()
        mem.peak  # {"param": ..., "buffer": ..., "grad": ..., "act": ..., "temp": ..., "optim": ..., "total": ...}

    The same tracker runs on real tensors and on fake ones (FakeTensorMode: storages with a size
    and no bytes), so a simulated rank and a real one are measured alike: the memory above the
    runtime (torch's own, the allocator's rounding and caching are not in it). The optimizer's
    state appears at the end of a first step, and a later step holds it through forward and
    backward: `prime_optimizer_state` first, then the step, gives that steady-state peak in one
    step (a second step is not possible under fake tensors: DDP rebuilds its buckets then).
    """

    CATEGORIES = {"Parameter": "param", "Buffer": "buffer", "Gradient": "grad", "Activation": "act",
                  "Temp": "temp", "Optstate": "optim", "Other": "other"}

    def __init__(self, modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer] = (), *,
                 module_hooks: bool = True):
        from torch.distributed._tools.mem_tracker import MemTracker

        modules = list(modules)
        roots = {id(m) for m in modules}

        propagation = self._propagation = _ShardingPropagation()

        class Tracker(MemTracker):
            """MemTracker refuses a root module's second forward before `reset_mod_stats()` (its per-module
            figures would mix); gradient accumulation and pipeline schedules call the root once per
            micro-batch. Its per-module figures are not read here, only the peak, which a reset keeps.

            Ops run by DTensor's sharding propagation are not counted (`_ShardingPropagation`)."""

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
                if propagation.depth:
                    return func(*args, **(kwargs or {}))
                return super().__torch_dispatch__(func, types, args, kwargs)

            def _pre_fw_hook(self, module, inputs):
                if id(module) in roots and module in self.memory_tracking and not self._mod_tracker.is_bw:
                    self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

            # A pipeline runs a micro-batch's forward before an earlier one's backward: the reset
            # above has dropped the module figures that backward's hooks would add to (KeyError in
            # MemTracker). Those figures are not read; the peak does not depend on them.
            def _post_fw_hook(self, module, inputs, outputs):
                if module in self.memory_tracking:
                    super()._post_fw_hook(module, inputs, outputs)

            def _pre_bw_hook(self, module, args):
                if module is None or module in self.memory_tracking:
                    super()._pre_bw_hook(module, args)

            def _post_bw_hook(self, module, args):
                if module is None or module in self.memory_tracking:
                    super()._post_bw_hook(module, args)

            def _track_module_params_and_buffers(self, module, install_grad_hooks=True):  # noqa: ANN001, ANN202
                # MemTracker hooks every parameter's gradient, and a frozen one (LoRA's base) refuses a
                # hook: marked as hooked already, with handles that remove nothing.
                for param in module.parameters():
                    if not param.requires_grad:
                        self._param_to_grad_hook_handles.setdefault(param, (_NO_HOOK, _NO_HOOK))
                return super()._track_module_params_and_buffers(module, install_grad_hooks)

            def _update_peak_stats(self, peak_state) -> None:
                # After every op MemTracker also walks every module it knows for the per-module peaks,
                # which are not read here: 60% of a simulated 1B step (measured with cProfile). Only the
                # process-wide peak, as MemTracker keeps it.
                snapshot, peak, peak_snap = (getattr(self, k, None) for k in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap"))
                if snapshot is None or peak is None or peak_snap is None:  # another torch's MemTracker
                    return super()._update_peak_stats(peak_state)
                for dev, dev_snap in snapshot.items():
                    if peak.get(dev, 0) < dev_snap["Total"]:
                        peak[dev] = dev_snap["Total"]
                        peak_snap[dev] = dict(dev_snap)

        self._tracker = Tracker()
        if not module_hooks:
            self._tracker._mod_tracker = _NoModuleHooks()
        self._tracker.track_external(*modules, *optimizers)
        self.peak: dict[str, int] = {}

    def __enter__(self) -> PeakMemory:
        self._propagation.__enter__()
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)
        self._propagation.__exit__(*exc)
        peak: dict[str, int] = {}
        for per_device in self._tracker.get_tracker_snapshot("peak").values():
            for key, nbytes in per_device.items():
                name = "total" if key == "Total" else self.CATEGORIES.get(getattr(key, "value", str(key)), str(key))
                peak[name] = peak.get(name, 0) + int(nbytes)
        self.peak = peak


class _NoHook:
    """A hook handle for a hook never registered (`PeakMemory`'s frozen parameters)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class _NoModuleHooks:
    """MemTracker's module tracker, without the module hooks: the tensors are still tracked, with
    what is made in backward counted as temporary, but no module is told apart (`PeakMemory`
    reads only the process-wide peak). For the steps whose backward the hooks break: the
    zero-bubble schedules' input-gradient pass is an `autograd.grad` that a module's multi-grad
    hook makes torch refuse ("A leaf node was passed to _will_engine_execute_node", torch 2.13)."""

    parents: frozenset = frozenset({"Global"})

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def register_user_hooks(self, *hooks) -> None:  # noqa: ANN002 - MemTracker's four hooks, not used
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module: torch.nn.Module) -> None:
        return None

    def __enter__(self) -> _NoModuleHooks:
        return self

    def __exit__(self, *exc) -> None:
        pass


def prime_optimizer_state(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Create each optimizer's state as its first step does (a step on zero gradients, which are
    then dropped), so that the step measured next holds it throughout, as every step after the
    first does. The weights move as a step with zero gradients moves them (weight decay): for
    measuring memory, not for training."""
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
