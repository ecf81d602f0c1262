"""A few calls that make a user's own training loop distributed, in the manner of Fabric/Accelerate.

    env = meshrun.init()
    model = meshrun.prepare_model(model)            # to env.device, wrapped in DDP when world > 1
    optimizer = torch.optim.AdamW(model.parameters())   # build it after prepare_model
    loader = meshrun.prepare_dataloader(dataset, batch_size=32)   # disjoint per rank, reshuffled per epoch

See examples/api_custom_loop.py. Run with `meshrun launch --nproc-per-node N your_script.py`.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.data import DataLoader, Dataset

from meshrun.data.sampler import ResumableDistributedSampler
from meshrun.debug.optim_check import check_optimizer
from meshrun.errors import MeshrunError
from meshrun.parallel.ddp import apply_ddp
from meshrun.runtime.process import Runtime
from meshrun.runtime.session import current, init


def _env() -> Runtime:
    return current() or init()


def prepare_model(model: nn.Module) -> nn.Module:
    """Move `model` to this rank's device and wrap it for data parallelism (DDP when world > 1).

    `device_ids` is passed only on accelerators (the guide's `device_ids` row). Build the
    optimizer afterwards, on the returned model's parameters.
    """
    env = _env()
    model = model.to(env.device)
    return apply_ddp(model, env.device) if env.world_size > 1 else model


def prepare_dataloader(
    data: Dataset | DataLoader,
    *,
    batch_size: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader over this rank's disjoint share of a map-style dataset.

    `data` is a Dataset, or a DataLoader whose dataset, batch size, collate_fn and workers are
    kept. The sampler reshuffles every epoch by itself (no `set_epoch` to forget) and drops the
    ragged end so every rank runs the same number of steps (unequal counts hang DDP).
    """
    env = _env()
    if isinstance(data, DataLoader):
        dataset = data.dataset
        batch_size = batch_size or data.batch_size
        loader_kwargs.setdefault("collate_fn", data.collate_fn)
        loader_kwargs.setdefault("num_workers", data.num_workers)
        loader_kwargs.setdefault("pin_memory", data.pin_memory)
    else:
        dataset = data
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise MeshrunError(
            f"prepare_dataloader needs a map-style Dataset (with __len__ and __getitem__), got "
            f"{type(dataset).__name__}; shard an IterableDataset by rank yourself"
        )
    sampler = ResumableDistributedSampler(len(dataset), env.world_size, env.rank, seed, shuffle=shuffle)
    return DataLoader(dataset, batch_size=batch_size or 1, sampler=sampler, drop_last=True, **loader_kwargs)


def prepare(model: nn.Module, optimizer=None, dataloader=None):
    """`prepare_model` and `prepare_dataloader` in one call; returns what was given, prepared.

    An optimizer built before DDP wrapping keeps working (DDP reuses the same parameters), so it is
    returned as it is.
    """
    prepared: list[Any] = [prepare_model(model)]
    if optimizer is not None:
        check_optimizer(prepared[0], optimizer)  # e.g. built before fully_shard: a silent no-op
        prepared.append(optimizer)
    if dataloader is not None:
        prepared.append(prepare_dataloader(dataloader))
    return prepared[0] if len(prepared) == 1 else tuple(prepared)
