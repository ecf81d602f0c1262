"""`meshrun.check_dataloader(loader)`: warn when ranks read the same data (the guide's row 各 rank 数据重复).

Two mistakes, both silent in torch: no DistributedSampler (every rank gets every batch), and a
DistributedSampler whose `set_epoch` is never called (every epoch repeats the first one's order).
The first is checked at once, by comparing a fingerprint of each rank's first batch over the
process group (a collective: call it on every rank). The second is watched from then on: the
loader's sampler is wrapped, and an epoch whose order equals the previous one's warns.
"""

from __future__ import annotations

import hashlib
import sys
import warnings

import torch

WARNING_MARK = "meshrun: data warning:"  # `meshrun diagnose` looks for it in the rank logs


class DataDuplicationWarning(UserWarning):
    """Ranks, or epochs, see the same batches."""


def _warn(message: str) -> None:
    print(f"{WARNING_MARK} {message}", file=sys.stderr, flush=True)
    warnings.warn(message, DataDuplicationWarning, stacklevel=3)


def batch_digest(batch) -> str:
    """A hash of every tensor (and plain value) in a batch, the same for the same data on any rank."""
    digest = hashlib.sha1()

    def feed(value) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(str((value.dtype, tuple(value.shape))).encode())
            digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                feed(key)
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                feed(item)
        else:
            digest.update(repr(value).encode())

    feed(batch)
    return digest.hexdigest()


class _EpochWatch(torch.utils.data.Sampler):
    """Wraps a shuffling sampler; warns when an epoch's order equals the previous epoch's."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.previous: int | None = None
        self.warned = False

    def __iter__(self):
        order = list(iter(self.inner))
        key = hash(tuple(order))
        if self.previous == key and len(order) > 1 and not self.warned:
            self.warned = True
            epoch = getattr(self.inner, "epoch", None)
            _warn(f"this epoch repeats the previous epoch's order (sampler epoch {epoch}): call "
                  f"sampler.set_epoch(epoch) at the start of every epoch, or use meshrun.prepare_dataloader, "
                  f"whose sampler reshuffles by itself")
        self.previous = key
        return iter(order)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def check_dataloader(loader, *, group=None) -> bool:
    """Warn if every rank's first batch is identical; watch later epochs for a repeated order.

    A collective over `group` (default: the world): call it on every rank, before training.
    Returns True when no duplication was found.
    """
    import torch.distributed as dist

    ok = True
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        first = next(iter(loader))
        digests: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(digests, batch_digest(first), group=group)
        if len(set(digests)) == 1:
            ok = False
            _warn(f"all {len(digests)} ranks read the identical first batch: the DataLoader has no "
                  f"DistributedSampler; pass sampler=DistributedSampler(dataset) (and call set_epoch every "
                  f"epoch), or build it with meshrun.prepare_dataloader(dataset, batch_size=...)")
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    if inner is not None and getattr(inner, "shuffle", False) and hasattr(inner, "set_epoch") \
            and not isinstance(inner, _EpochWatch):
        batch_sampler.sampler = _EpochWatch(inner)
    return ok
