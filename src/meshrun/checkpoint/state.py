"""TrainState, what a run must capture to continue exactly, and what a checkpoint stores of it.

A checkpoint holds DCP tensors, a small train-state file and per-rank RNG states.

Model and optimizer go through torch.distributed.checkpoint.state_dict, which names every
tensor by its unwrapped FQN (no DDP `module.`, FSDP or checkpoint-wrapper prefixes) and keeps
FSDP/TP shards as DTensors, so DCP reshards them on load into any other layout. The optimizer
state is flattened (`state.<fqn>.exp_avg`, as torchtitan does), so the dicts of several model
parts (pipeline stages) merge by plain update and each part picks its own keys on load.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from meshrun.data.loader import InfiniteLoader

_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def inner_optimizers(optimizer: torch.optim.Optimizer):
    """What DCP saves and loads for `optimizer`: it, or the torch optimizers it steps together
    (`optimizers`, e.g. meshrun.train.optimizers.MuonWithAdamW); DCP takes a list per part."""
    return getattr(optimizer, "optimizers", optimizer)


@dataclass
class TrainState:
    """The live objects of one run; `step` counts optimizer steps completed.

    Lists, not single objects, because pipeline parallel may give one rank several stages (model
    parts); each part has its own optimizer and LR scheduler (as in torchtitan), so that every
    optimizer's state is keyed by its part's parameter names, which stay the same whatever the
    layout. Without PP every list holds one element.
    """

    model_parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    train_loader: InfiniteLoader
    step: int = 0
    extra: dict = field(default_factory=dict)  # small picklable items to carry (e.g. losses so far)
    scaler: object | None = None  # fp16's gradient scaler (meshrun.train.precision.LossScaler), or None
    # LoRA (meshrun.models.lora): only the trainable parameters are saved and loaded, the frozen
    # base is rebuilt from its source; its fingerprint must match the checkpoint's on resume.
    adapters_only: bool = False
    base_fingerprint: str | None = None


def _own_names(part: nn.Module, adapters_only: bool) -> set[str] | None:
    """The state dict names a checkpoint keeps of `part`: None = all, else its trainable ones."""
    if not adapters_only:
        return None
    from meshrun.models.lora import trainable_names

    return trainable_names(part)


def tensor_state(state: TrainState) -> dict:
    """{"model": {fqn: tensor}, "optim": {flat key: tensor or value}} over every model part."""
    model, optim = {}, {}
    for part, opt in zip(state.model_parts, state.optimizers, strict=True):
        keep = _own_names(part, state.adapters_only)
        model.update({k: v for k, v in get_model_state_dict(part).items() if keep is None or k in keep})
        optim.update(get_optimizer_state_dict(part, inner_optimizers(opt), options=_OPTIM))
    return {"model": model, "optim": optim}


def apply_tensor_state(state: TrainState, loaded: dict) -> None:
    """Copy loaded (resharded) tensors back into every model part and optimizer."""
    for part, opt in zip(state.model_parts, state.optimizers, strict=True):
        keep = _own_names(part, state.adapters_only)
        own = [k for k in get_model_state_dict(part) if keep is None or k in keep]
        set_model_state_dict(part, {k: loaded["model"][k] for k in own},
                             options=StateDictOptions(strict=keep is None))
        set_optimizer_state_dict(part, inner_optimizers(opt), loaded["optim"], options=_OPTIM)


def train_state(state: TrainState, *, layout: dict, config_toml: str) -> dict:
    """The small, rank-independent part: plain values that torch.load(weights_only=True) reads."""
    return {
        "step": state.step,
        "schedulers": state.schedulers[0].state_dict(),  # every part follows the same schedule
        "data": state.train_loader.state_dict(),
        "layout": layout,
        "config": config_toml,
        "extra": dict(state.extra),
        "scaler": state.scaler.state_dict() if state.scaler is not None else None,
        "base_fingerprint": state.base_fingerprint,
    }


def check_base(state: TrainState, saved: dict, path) -> None:
    """A LoRA checkpoint resumes only on the base weights it was trained on (one line otherwise)."""
    from meshrun.checkpoint.manifest import CheckpointError

    before, now = saved.get("base_fingerprint"), state.base_fingerprint
    if before != now:
        raise CheckpointError(f"{path} was trained on base weights with fingerprint {before or 'none (no LoRA)'}, "
                              f"this run's base has {now or 'none (lora.rank=0)'}: resume on the same model.hf / "
                              "model.init_from / train.seed, or set checkpoint.resume=never")


def apply_train_state(state: TrainState, saved: dict) -> None:
    state.step = int(saved["step"])
    for scheduler in state.schedulers:
        scheduler.load_state_dict(_fit_groups(saved["schedulers"], len(scheduler.optimizer.param_groups)))
    state.train_loader.load_state_dict(saved["data"])
    state.extra.update(saved.get("extra", {}))
    if state.scaler is not None and saved.get("scaler"):
        state.scaler.load_state_dict(saved["scaler"])


def _fit_groups(sched: dict, groups: int) -> dict:
    """A scheduler state saved with another number of parameter groups (another layout splits the
    groups otherwise: train/optimizers.py keeps plain tensors and DTensors apart), for `groups`:
    its per-group lists (base_lrs, _last_lr) hold one value for every group (one optim.lr), which
    each group takes. Per-group values that differ are kept as they are (and torch refuses them)."""
    fitted = dict(sched)
    for key, value in sched.items():
        if isinstance(value, list) and value and len(value) != groups and all(v == value[0] for v in value):
            fitted[key] = [value[0]] * groups
    return fitted


def rng_state() -> dict:
    """This process's RNG states, as tensors and lists (loadable with weights_only=True)."""
    version, inner, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(inner), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class SaveShare:
    """What one rank's part of a checkpoint save (`dcp.save` of `tensor_state`) holds, in bytes:
    `own`, the tensors (shards) no other rank holds; `replicated`, those other ranks hold too,
    which DCP writes once among them (its planner deduplicates, spreading them over the holders);
    `expected`, own plus each replicated tensor's share (its bytes / its holders)."""

    own: int
    replicated: int
    expected: float


def save_share(state: TrainState, *, world_size: int, pp: int = 1) -> SaveShare:
    """This rank's `SaveShare` of `tensor_state(state)`, what `dcp.save` is given (no I/O): DCP
    writes each tensor as this rank's local chunk (a DTensor's local shard, a plain tensor whole).
    Not through DCP's own planner: its local plan computes every shard's global offset over the
    whole mesh, 45 s a rank for a 70B model at 8,192 ranks, for the same sizes.

    Every rank of a pipeline stage (world_size / pp) has each of the stage's tensors; a chunk of
    one is held by those ranks over the chunks it is cut into (a DTensor's mesh dimensions that
    do not replicate it; a norm sharded over dp_shard only, under tp, is held by each tp rank; a
    plain tensor, one chunk, by all of them)."""
    from torch.distributed.tensor import DTensor

    tensors = tensor_state(state)
    own = replicated = 0
    expected = 0.0
    for value in [*tensors["model"].values(), *tensors["optim"].values()]:
        if not isinstance(value, torch.Tensor):
            continue  # plain values (the optimizer's hyperparameters) go into DCP's metadata
        pieces = 1  # the distinct chunks the tensor is cut into
        if isinstance(value, DTensor):
            for dim, placement in enumerate(value.placements):
                if not placement.is_replicate():  # Shard, and FSDP-over-TP's _StridedShard (not is_shard())
                    pieces *= value.device_mesh.size(dim)
            value = value.to_local()
        nbytes = value.numel() * value.element_size()
        holders = max(1, world_size // pp // pieces)
        if holders > 1:
            replicated += nbytes
        else:
            own += nbytes
        expected += nbytes / holders
    return SaveShare(own, replicated, expected)
