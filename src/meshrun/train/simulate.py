"""The real layout at full world size, in this one process: `meshrun plan CONFIG --simulate`.

    sim = simulate(cfg, nnodes=128, nproc_per_node=8)         # 1,024 ranks, a few of them built
    for rank in sim.ranks:
        print(rank.rank, rank.params, rank.grads, rank.optim, rank.collectives)

For each representative rank the build a launch would do runs here, for real: the resolver
(`resolve_layout`, the same one-line refusals as a launch), the DeviceMesh of the whole world,
`build_layout` (pp split, TP, activation checkpointing, FSDP/HSDP, context parallel, DDP), the
run's optimizer, and one training step (`layout_step`: micro-batches, the pipeline schedule,
the loss, clipping, the optimizer step) with the optimizer's state already there, as in every
step but the first, and its peak memory (torch's `MemTracker`, through
`meshrun.plan.measure.PeakMemory`). Two things of torch make that possible on a laptop:
- its fake process group (backend "fake", `torch.testing._internal.distributed.fake_pg`): this
  process is rank r of N and every collective returns at once, moving nothing;
- `FakeTensorMode`: the weights, activations and optimizer state have shapes, dtypes and devices
  but no storage, and no kernel runs. `build_layout(fake_mode=...)` gives the sharded weights
  fake storage instead of filling them.
So the bytes below are those of the real local shards, and the collectives are the ones the
step issued (`meshrun.plan.measure.Collectives`), named by their mesh dimension.

Pipelines: torch's schedule starts by asking its peers (a P2P vote read with `.item()`, then the
shapes each stage sends, as pickled objects), which a fake process group cannot answer. The
simulation answers for them in a first step (`meshrun.train.simulate_pipeline`: the shapes a
probe of the first stage gives) and measures the second, as a real run's steady step: the
schedule as torch runs it, its sends and receives counted. The zero-bubble schedules are
measured without MemTracker's module hooks (`PeakMemory(module_hooks=False)`).

Representative ranks: each stage is simulated at its first rank and at the rank with the last
dp_shard, cp and tp coordinates (the same rank when they coincide). Shards are torch.chunk's,
never larger than the first, so the first rank holds the most of its stage; the last rank holds
the last shard of an uneven split. A rank in between can hold a third size (5 rows over 4 ranks:
2, 2, 1, 0), never more than the first's. Gradients are counted as one per
trainable parameter's local shard (what FSDP/DDP hold during a step); optimizer bytes are the
state the step created.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshrun.parallel.resolve import ResolvedLayout


@dataclass(frozen=True)
class CollectiveUse:
    """One kind of collective over one mesh dimension in a training step, on one rank."""

    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, send, recv
    dim: str  # the mesh dimension (or flattened dimensions, e.g. "dp"); "world" for the default group
    count: int
    bytes: int  # this rank's input buffers, summed over the calls


@dataclass(frozen=True)
class RankSimulation:
    """What one rank holds and communicates in one training step."""

    rank: int
    coords: dict[str, int]  # its coordinate on each mesh dimension
    params: int
    grads: int
    optim: int
    collectives: tuple[CollectiveUse, ...] = field(default_factory=tuple)
    peak: dict[str, int] = field(default_factory=dict)
    """The most tensor bytes held at once in a step, by category (param, buffer, grad, act,
    temp, optim) and "total" (`meshrun.plan.measure.PeakMemory`); empty where not measured."""
    checkpoint: dict[str, float] = field(default_factory=dict)
    """Its part of a checkpoint save (`meshrun.checkpoint.state.SaveShare`: bytes of its own
    shards, of the tensors other ranks hold too, and what it writes once DCP shares those out)."""

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optim


def representative_ranks(layout: ResolvedLayout) -> list[int]:
    """Each pipeline stage's first rank and its rank with the last dp_shard, cp and tp coordinates."""
    from meshrun.parallel.dims import MESH_AXES

    dims = layout.dims
    shape = [getattr(dims, name) for name in MESH_AXES] if layout.use_mesh else [dims.world_size]
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    if not layout.use_mesh:  # plain DDP: every rank alike but the last by nothing; one is enough
        return [0]
    axis = {name: i for i, name in enumerate(MESH_AXES)}
    ranks = []
    for stage in range(dims.pp):
        first = stage * stride[axis["pp"]]
        last = first + sum((shape[axis[name]] - 1) * stride[axis[name]] for name in ("dp_shard", "cp", "tp"))
        ranks += [first] + ([last] if last != first else [])
    return ranks


def _mesh_dims(layout) -> dict[str, str]:
    """Process group name -> the mesh dimension(s) it spans, for the process groups this process
    knows. A group is named by its ranks, not its object: DTensor and FSDP may create their own
    groups over a dimension's ranks (the same communication), and group names differ between
    processes that created groups in another order."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    by_ranks: dict[tuple[int, ...], str] = {}
    mesh = layout.mesh
    if mesh is not None:
        for dim in mesh.mesh_dim_names or ():
            by_ranks.setdefault(tuple(dist.get_process_group_ranks(mesh[dim].get_group())), dim)
        root = getattr(mesh, "_get_root_mesh", lambda: mesh)()
        for flat, sub in getattr(root, "_flatten_mapping", {}).items():  # "dp", "dp_shard_cp"
            by_ranks.setdefault(tuple(dist.get_process_group_ranks(sub.get_group())), flat)
        experts = layout.dims.expert_meshes(mesh) if layout.dims is not None else None
        for dim in ("ep", "efsdp") if experts is not None else ():  # ep > 1: dp_shard unflattened
            by_ranks.setdefault(tuple(dist.get_process_group_ranks(experts[dim].get_group())), dim)
    by_ranks.setdefault(tuple(range(dist.get_world_size())), "world")
    names = {}
    for group in list(_world.pg_names):
        ranks = tuple(dist.get_process_group_ranks(group))
        names[group.group_name] = by_ranks.get(ranks, "ranks " + ",".join(map(str, ranks)))
    return names


def simulate_rank(build_model: Callable[[], nn.Module], layout: ResolvedLayout, rank: int, *,
                  build_optimizer: Callable[[nn.Module], torch.optim.Optimizer], seq_len: int, dtype: str = "fp32", grad_clip: float = 1.0, grad_accum: int = 1,
                  sync_each_micro_batch: bool = True,
                  device_type: str = "cpu") -> RankSimulation:
    """Build `layout` as rank `rank` of its world under a fake process group and fake tensors,
    and run one training step; the process group is gone again when this returns.

    `build_model()` returns the model on the meta device (as the trainer builds it);
    `build_optimizer(part)` the run's optimizer of one built part. Every rank reads
    `layout.options.batch_size` sequences of `seq_len` tokens per micro-batch.

    Of `grad_accum` micro-batches, three run: the first, one like every middle one and the last
    (the last syncs what the others leave, the first finds no gradients yet). The middle ones hold
    the same memory and issue the same collectives, so the skipped ones' are the middle one's,
    counted again (`MIDDLE_MICRO_BATCHES`).
    """
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # registers the "fake" backend
    )

    from meshrun.parallel.layout import build_layout
    from meshrun.parallel.pipeline import stage_module
    from meshrun.plan.measure import Collectives, PeakMemory, prime_optimizer_state
    from meshrun.train.simulate_pipeline import (
        module_hooks_allowed,
        stage_boundary,
        without_p2p_metadata,
    )
    from meshrun.train.step import layout_step

    if dist.is_initialized():
        raise RuntimeError("simulate_rank needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        model = build_model()
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        device = torch.device(device_type)
        built = build_layout(model, layout, device=device, seed=0, fake_mode=fake)
        for part in built.parts:
            if isinstance(part, DistributedDataParallel):
                part.register_comm_hook(part.process_group, _all_reduce_hook)
        optimizers = [build_optimizer(part) for part in built.parts]
        groups = _mesh_dims(built)
        probe = None  # the first stage without its blocks, parallelized as the stages were (stage_boundary)
        if built.pipeline is not None:
            probe = built.pipeline.parallelize_part(stage_module(build_model(), 0, layout.pipeline.num_stages, [],
                                                                 in_place=True))
        with fake:
            tokens = torch.zeros(layout.options.batch_size, seq_len, dtype=torch.long, device=device)

            def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
                while True:
                    yield tokens, tokens

            if built.pipeline is not None:  # the schedule's first step infers its shapes: a step of its own
                without_p2p_metadata(built.pipeline, stage_boundary(probe, built, tokens, dtype))
                layout_step(built, optimizers, batches(), grad_accum=1, dtype=dtype, grad_clip=grad_clip,
                            sync_each_micro_batch=sync_each_micro_batch)
            prime_optimizer_state(optimizers)  # the step below holds the optimizer state, as every step but the first
            run = min(grad_accum, MIDDLE_MICRO_BATCHES + 2)
            memory = PeakMemory(built.parts, optimizers, module_hooks=module_hooks_allowed(layout))
            with memory, Collectives() as comms:
                marked = _MicroBatchMarks(batches(), comms)
                layout_step(built, optimizers, marked, grad_accum=run, dtype=dtype, grad_clip=grad_clip,
                            sync_each_micro_batch=sync_each_micro_batch)
            marked.count_skipped(grad_accum - run)
        return rank_usage(built, optimizers, comms, groups, peak=memory.peak)
    finally:
        dist.destroy_process_group()


MIDDLE_MICRO_BATCHES = 1
"""Micro-batches between the first and the last that a simulated step runs; the rest repeat them."""


class _MicroBatchMarks:
    """The step's micro-batches, with the collectives recorded so far when each is asked for: the
    second's start to the third's is one middle micro-batch's, which `count_skipped` adds again."""

    def __init__(self, batches: Iterator, comms) -> None:  # noqa: ANN001 - a meshrun.plan.measure.Collectives
        self.batches, self.comms, self.marks = batches, comms, []

    def __iter__(self) -> _MicroBatchMarks:
        return self

    def __next__(self):  # noqa: ANN204
        self.marks.append(({key: list(value) for key, value in self.comms.records.items()}, self.comms.received))
        return next(self.batches)

    def count_skipped(self, skipped: int) -> None:
        if skipped <= 0:
            return
        (before, received_before), (after, received_after) = self.marks[1], self.marks[2]
        for key, (count, nbytes) in after.items():
            was = before.get(key, [0, 0])
            entry = self.comms.records[key]
            entry[0] += skipped * (count - was[0])
            entry[1] += skipped * (nbytes - was[1])
        self.comms.received += skipped * (received_after - received_before)


def _all_reduce_hook(group, bucket):  # noqa: ANN202 - DDP refuses a string annotation (this module's are)
    """DDP's all-reduce of a gradient bucket, as its default hook issues it; the fake process
    group's work carries no result, which DDP's reducer needs, so the future here holds the bucket."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group, async_op=True)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


def rank_usage(built, optimizers: list[torch.optim.Optimizer], comms, groups: dict[str, str] | None = None,
               peak: dict[str, int] | None = None) -> RankSimulation:
    """This rank's bytes and collectives after a step of `built` (a BuiltLayout) recorded by
    `comms` (a `Collectives`), and `peak` (a `PeakMemory`'s): what `simulate_rank` reports, and
    what a real run measures the same way."""
    import torch.distributed as dist

    from meshrun.checkpoint.state import TrainState, save_share
    from meshrun.models.lora import has_adapters
    from meshrun.parallel.dims import MESH_AXES
    from meshrun.plan.measure import local_bytes

    groups = _mesh_dims(built) if groups is None else groups
    params = [p for part in built.parts for p in part.parameters()]
    states = [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    coords = {}
    if built.mesh is not None:
        coords = dict(zip(MESH_AXES, built.mesh.get_coordinate() or (), strict=False))
    uses = tuple(CollectiveUse(kind, groups.get(group, group or "?"), count, nbytes)
                 for (kind, group), (count, nbytes) in sorted(comms.records.items()))
    adapters_only = any(has_adapters(part) for part in built.parts)  # LoRA: a checkpoint holds the adapters
    share = save_share(TrainState(built.parts, optimizers, [], None, adapters_only=adapters_only),
                       world_size=built.world_size, pp=built.pp)
    return RankSimulation(dist.get_rank() if dist.is_initialized() else 0, coords, local_bytes(params),
                          local_bytes(p for p in params if p.requires_grad), local_bytes(states), uses, dict(peak or {}),
                          {"own": share.own, "replicated": share.replicated, "expected": share.expected})


RANK_TIMEOUT_S = 900.0
"""The most one simulated rank may take (an 8B model's build and step take seconds)."""


def _simulate_child(writer, args: tuple, kwargs: dict) -> None:
    """In the child process: `simulate_rank(*args, **kwargs)`, its result or error sent on `writer`.
    What the parent had imported is frozen first: the step's collections skip it (a full one walks
    torch's few hundred thousand objects otherwise)."""
    import gc
    import logging
    import traceback
    import warnings

    from meshrun.errors import MeshrunError

    gc.freeze()
    warnings.simplefilter("ignore")  # the real run's warnings (FSDP views, DTensor's redistributions)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    try:
        writer.send(("ok", simulate_rank(*args, **kwargs)))
    except MeshrunError as exc:
        writer.send(("meshrun", exc))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line
        where = traceback.extract_tb(exc.__traceback__)[-1]
        writer.send(("error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]} "
                              f"(at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})"))


def simulate_rank_isolated(*args, timeout: float = RANK_TIMEOUT_S, context=None, **kwargs) -> RankSimulation:
    """`simulate_rank` in a child process, so that each simulated rank starts from a clean torch:
    DTensor caches its sharding decisions per process, keyed by a mesh that compares equal across
    fake worlds, and a cached local shape of rank 0 (an uneven shard) would be rank 1's (measured:
    a 259-token vocabulary under TP 2); a process that ran DTensor ops before may also issue fewer
    collectives (TP's output all-gather, measured). `context`: a multiprocessing context, by
    default "fork" (this process has built nothing: the CLI); a process that has (a test session)
    passes a forkserver's, whose children start from the server's clean imports, and then the
    arguments must pickle. A MeshrunError in the child is raised here as itself; anything else as
    one MeshrunError line naming the rank."""
    child = _Child(args, kwargs, context)
    try:
        return child.result(timeout)
    finally:
        child.stop()


def simulate_ranks_isolated(build_model: Callable[[], nn.Module], layout: ResolvedLayout, ranks: list[int], *,
                            jobs: int | None = None, timeout: float = RANK_TIMEOUT_S, context=None,
                            **kwargs) -> list[RankSimulation]:
    """`simulate_rank_isolated` for each of `ranks`, up to `jobs` children at once (default: the
    CPUs this process may use; a simulated rank is one busy core of Python). `timeout` is each
    rank's, from its start. The first failure stops the others (by pid) and is raised."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    jobs = max(1, jobs or cpus or 1)
    waiting, running, done = list(ranks), [], {}
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                rank = waiting.pop(0)
                running.append((rank, _Child((build_model, layout, rank), kwargs, context)))
            rank, child = running.pop(0)
            try:
                done[rank] = child.result(timeout - child.elapsed())
            finally:
                child.stop()
    finally:
        for _, child in running:
            child.stop()
    return [done[rank] for rank in ranks]


class _Child:
    """One simulated rank's process, started at construction; `result` waits for what it sends."""

    def __init__(self, args: tuple, kwargs: dict, context) -> None:  # noqa: ANN001 - a multiprocessing context
        import multiprocessing

        context = context or multiprocessing.get_context("fork")
        self.rank = args[2]
        self.started = time.monotonic()
        self.reader, writer = context.Pipe(duplex=False)
        self.process = context.Process(target=_simulate_child, args=(writer, args, kwargs), daemon=True)
        self.process.start()
        writer.close()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def result(self, timeout: float) -> RankSimulation:
        from meshrun.errors import MeshrunError

        try:
            if not self.reader.poll(max(timeout, 0.0)):
                raise MeshrunError(f"--simulate: rank {self.rank} took over {self.elapsed():.0f} s; stopped")
            kind, value = self.reader.recv()
        except EOFError:
            self.process.join(10)
            kind, value = "error", f"the process simulating it exited with code {self.process.exitcode}"
        if kind == "ok":
            return value
        if kind == "meshrun":
            raise value
        raise MeshrunError(f"--simulate: rank {self.rank} could not be built and stepped under fake tensors ({value}); "
                           "a limit of the simulation, not necessarily of the layout: run it for real to check")

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()  # by its pid
        self.process.join(10)
        self.reader.close()


@dataclass(frozen=True)
class Simulation:
    layout: ResolvedLayout
    ranks: list[RankSimulation]
    seconds: float
    note: str = ""  # what was assumed (a tokenizer not readable here)


def simulate(cfg, world_size: int, *, vocab_size: int | None = None) -> Simulation:
    """`cfg`'s model, layout and optimizer at `world_size` ranks: each representative rank built
    and stepped once (`simulate_rank`). Refusals are the launch's, one line each."""
    from meshrun.models.factory import build_model
    from meshrun.models.from_config import model_args_from_config, model_shape_from_config
    from meshrun.models.lora import apply_run_lora
    from meshrun.models.meta import on_meta
    from meshrun.parallel.resolve import ParallelOptions, resolve_layout
    from meshrun.train.optimizers import build_optimizer

    started = time.perf_counter()
    note = ""
    if vocab_size is None:  # the run's tokenizer, as the launch's preflight reads it
        from meshrun.data.tokenizer import load_tokenizer
        from meshrun.errors import MeshrunError

        try:
            vocab_size = load_tokenizer(cfg.data.tokenizer).vocab_size
        except MeshrunError:  # planned on another machine than the cluster's: the model's own, said
            vocab_size = model_args_from_config(cfg.model).vocab_size
            note = (f"data.tokenizer={cfg.data.tokenizer!r} is not readable here: the model's own vocabulary "
                    f"({vocab_size}) is simulated")
    if cfg.train.compile:  # fake tensors run eager; inductor's fused kernels would change the activations
        note = "; ".join(filter(None, [note, "train.compile=true: the step is simulated eager (uncompiled); a "
                                             "compiled step usually holds fewer activations"]))
    shape = (model_shape_from_config(cfg.model, model_args_from_config(cfg.model, vocab_size))
             if not cfg.model.factory else None)
    layout = resolve_layout(ParallelOptions.from_config(cfg), world_size, shape)

    def model() -> nn.Module:
        with on_meta():
            built = build_model(cfg.model, vocab_size, seed=cfg.train.seed)
        return apply_run_lora(built, cfg.lora, cfg.train.dtype)  # lora.rank > 0: the base frozen, as the launch's

    # Each simulated rank is a fork of this process, and its FakeTensorMode imports torch._dynamo
    # (1.5-3 s here): imported once before the forks, every rank starts with it.
    import torch._dynamo  # noqa: F401

    ranks = simulate_ranks_isolated(model, layout, representative_ranks(layout),
                                    build_optimizer=lambda part: build_optimizer(part, cfg.optim),
                                    seq_len=cfg.data.seq_len, dtype=cfg.train.dtype, grad_clip=cfg.train.grad_clip,
                                    grad_accum=layout.options.grad_accum,
                                    sync_each_micro_batch=cfg.train.sync_each_micro_batch)
    return Simulation(layout, ranks, time.perf_counter() - started, note)
