"""From the `[parallel]` section to what the trainer holds: this rank's model parts, and where they sit.

    resolved = resolve_layout(ParallelOptions.from_config(cfg), env.world_size, ModelShape.from_model(model))
    layout = build_layout(model, resolved, device=env.device, seed=cfg.train.seed)  # model built on "meta"
    optimizers = [build_optimizer(part, cfg.optim) for part in layout.parts]
    loss, grad_norm, seconds = layout_step(layout, optimizers, batches, ...)   # meshrun.train.step

`model` may live on the meta device: the layout splits it into pipeline stages, applies tp,
activation checkpointing and fsdp to each, then materialises every part on `device` with
`to_empty` + `init_weights(seed)` before any DDP wrap (DDP broadcasts real weights). A model
with real weights (a user factory without `init_weights`) goes through the same calls unchanged.

`strategy = "ddp"` with pp = 1 is the plain DDP path (no DeviceMesh); everything else goes over
one DeviceMesh: `parallelize_nd`, or `parallelize_pipeline` when pp > 1.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel.compile import apply_compile, layout_allows
from meshrun.parallel.context import ContextParallel
from meshrun.parallel.context import check_model as check_cp_model
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.parallelize import (
    _has_dtensors,
    full_state_dict,
    parallelize,
    parallelize_nd,
    parallelize_pipeline,
    unwrap_model,
)
from meshrun.parallel.resolve import ResolvedLayout, torch_dtype


@dataclass
class BuiltLayout:
    """This rank's share of the model and where it sits among the ranks: a record; the step and
    evaluation functions that take it are meshrun.train.step's."""

    parts: list[nn.Module]
    dp_rank: int
    dp_size: int
    device: torch.device
    world_size: int = 1
    pipeline: object | None = None
    dims: ParallelDims | None = None
    mesh: object | None = None
    loss_parallel: bool = False
    compiled: list[str] | None = None  # the blocks train.compile compiled (meshrun.parallel.compile)
    context_parallel: ContextParallel | None = None  # cp > 1: splits each batch's sequence

    @property
    def pp(self) -> int:
        return self.dims.pp if self.dims is not None else 1

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group() if self.pipeline is not None else None

    def train(self) -> None:
        for part in self.parts:
            part.train()

    def load_full_state_dict(self, state: dict[str, torch.Tensor], *, lora: bool = False) -> None:
        """Copy full (unsharded) tensors keyed by the original names into this rank's parts.

        Each rank keeps only its own slices (DTensor parameters take their local shard without
        communication) and each pipeline stage only its own names, so it needs no collective.
        `lora`: the parts carry LoRA layers (`wq.base_layer.weight`) and `state` is the base's
        (`wq.weight`); the adapters are left as they are.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        for part in self.parts:
            names = _state_names(part)
            if lora:
                own = {k: state[k.replace(".base_layer.", ".")] for k in names if ".lora_" not in k}
            else:
                own = {k: state[k] for k in names}
            set_model_state_dict(part, own, options=StateDictOptions(full_state_dict=True, strict=not lora))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full plain CPU tensors of the whole model on rank 0 ({} elsewhere); every rank calls it.

        Under PP each stage's first (dp 0, tp 0) rank sends its parts' full tensors to rank 0,
        one tensor at a time (point-to-point, after the names and shapes): rank 0 then holds the
        whole model once, as one process would, not pickled copies of every stage at once. The
        original parameter names make the merge a dict update.
        """
        if self.pipeline is None:
            model = self.parts[0]
            if _has_dtensors(model) or not dist.is_initialized() or dist.get_rank() == 0:
                return full_state_dict(model)
            return {}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state: dict[str, torch.Tensor] = {}
        for part in self.parts:  # collectives within the stage's dp/tp ranks, on all of them
            full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            state.update({k: v.detach().cpu().clone() for k, v in full.items()})
        sender = self.dp_rank == 0 and self.mesh["tp"].get_local_rank() == 0
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in state.items()} if sender else {}
        rank = dist.get_rank()
        listing: list | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(shapes, listing, dst=0)
        if rank != 0:
            if sender:
                for tensor in state.values():
                    dist.send(tensor, dst=0)
            return {}
        merged = dict(state)
        for src, names in enumerate(listing or []):
            if src == 0:
                continue
            for name, (shape, dtype) in (names or {}).items():
                merged[name] = torch.empty(shape, dtype=dtype)
                dist.recv(merged[name], src=src)
        return merged


def _state_names(part: nn.Module) -> list[str]:
    """The original state_dict names of `part` (wrappers' prefixes removed), without collectives."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return list(get_model_state_dict(part).keys())


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` still lives on the meta device (no storage)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def materialize(module: nn.Module, device: torch.device, seed: int | None, *, fake_mode=None) -> None:
    """Give a meta-built (and possibly sharded) `module` real storage on `device`, then fill it.

    `to_empty` allocates only what this rank holds (its FSDP/TP shards, its pipeline stage's
    blocks); `init_weights(seed)` draws every weight from a generator keyed by its name, so the
    values equal the eager build's in every layout, and recomputes derived buffers (RoPE).
    A module with real storage already is left as it is. With a `fake_mode` (a FakeTensorMode:
    meshrun.train.simulate) the storage is fake, shapes without bytes, and nothing is filled.
    """
    if not is_meta(module):
        return
    inner = unwrap_model(module)
    if not hasattr(inner, "init_weights"):
        raise TypeError(f"{type(inner).__name__} was built on the meta device but has no init_weights")
    if fake_mode is not None:
        with fake_mode:
            module.to_empty(device=device)
        if hasattr(inner, "retie"):  # what init_weights does first: a tied head counted once, as in a launch
            inner.retie()
        return
    module.to_empty(device=device)
    inner.init_weights(seed)


def build_layout(model: nn.Module, layout: ResolvedLayout, *, device: torch.device,
                 seed: int | None = None, compile: bool | None = False, fake_mode=None) -> BuiltLayout:
    """Split, shard and wrap `model` as the resolved `layout` says, materialising meta parts with `seed`.

    `layout` comes from `meshrun.parallel.resolve.resolve_layout`, the one place the rules live.
    Order (parallelize.py): pp split -> tp -> activation checkpointing -> fsdp -> materialise
    -> ddp. Build the optimizers on the returned layout's `parts` afterwards. `compile`
    (train.compile) compiles each part's blocks once tp/AC/fsdp are on, before ddp. A `fake_mode`
    (FakeTensorMode) gives the weights fake storage (`materialize`): a simulated build.
    """
    options, world_size = layout.options, layout.world_size
    compiled: list[str] = []
    tp = layout.dims.tp if layout.use_mesh else 1
    experts = getattr(getattr(model, "args", None), "experts", 0) or 0  # the built-in MoE (models/moe.py)
    compile = compile if layout_allows(compile, tp, options.sequence_parallel, layout.dims.cp, experts) else False

    def init(module: nn.Module) -> None:
        compiled.extend(apply_compile(module, compile))
        materialize(module, device, seed, fake_mode=fake_mode)

    if not layout.use_mesh:
        wrapped = parallelize(model, options, device=device, world_size=world_size,
                              activation_checkpointing=options.activation_checkpointing, materialize=init)
        return BuiltLayout([wrapped], dp_rank=dist.get_rank() if world_size > 1 else 0, dp_size=world_size,
                           device=device, world_size=world_size, compiled=compiled)
    dims = layout.dims
    if dims.cp_enabled:  # before any process group is split: a model that cannot be split says so
        check_cp_model(unwrap_model(model), dims.cp)
    mesh = dims.build_mesh(device.type)
    kwargs = dict(
        param_dtype=torch_dtype(layout.param_dtype),
        reduce_dtype=torch_dtype(layout.reduce_dtype),
        reshard_after_forward=options.fsdp_reshard_after_forward,
        cpu_offload=options.fsdp_cpu_offload,
        activation_checkpointing=options.activation_checkpointing,
        sequence_parallel=options.sequence_parallel,
        loss_parallel=options.loss_parallel,
        materialize=init,
    )
    built = BuiltLayout([], dp_rank=dims.dp_rank(mesh), dp_size=dims.dp_size, device=device,
                        world_size=world_size, dims=dims, mesh=mesh, loss_parallel=options.loss_parallel,
                        compiled=compiled, context_parallel=ContextParallel(mesh["cp"]) if dims.cp_enabled else None)
    if layout.pipeline is None:
        built.parts = [parallelize_nd(model, dims, mesh, device=device, **kwargs)]
    else:
        built.pipeline = parallelize_pipeline(model, dims, mesh, layout.pipeline, device=device,
                                              grad_accum=options.grad_accum, **kwargs)
        built.parts = built.pipeline.parts
    return built
