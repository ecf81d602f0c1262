"""A distributed sampler that reshuffles every epoch by itself and resumes exactly, at any rank count.

    sampler = ResumableDistributedSampler(len(dataset), num_replicas=dp_size, rank=dp_rank, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=True)
    for batch in loader: ...            # epoch 0; when it ends, the sampler moves to epoch 1 itself
    state = sampler.state_dict()        # {"epoch", "consumed", "seed", "num_replicas", ...}
    sampler.load_state_dict(state)      # continue after the last index handed out, on any dp size

How the position works, so that a resume is exactly-once even when the number of ranks changes:
every epoch has one global order, `perm = randperm(n, generator=seed + epoch)`. A pass that
starts at global position `c` gives rank r the items `perm[c + r], perm[c + r + R], ...`
(strided, not blocked, as in torch's DistributedSampler). Ranks advance in lock step, so after
each rank has taken k items the consumed part of the epoch is exactly the prefix `perm[:c + R*k]`,
and the position is one number, `consumed = c + R*k`. A run resumed with R' ranks splits the
rest, `perm[consumed:]`, among its R' ranks: nothing consumed comes back, and nothing is skipped.

`state_dict()` counts indices as consumed when they are handed out. With DataLoader workers the
DataLoader fetches batches ahead, so checkpoint `InfiniteLoader.state_dict()` (meshrun.data.loader),
which counts the batches actually delivered, in the same format.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from meshrun.errors import DataError

log = logging.getLogger(__name__)

STATE_VERSION = 1


class ResumableDistributedSampler(Sampler[int]):
    """This rank's disjoint share of a per-epoch permutation, with an exact, reshardable position.

    Args:
        data: a map-style dataset (anything with len) or its length.
        num_replicas: number of data-parallel ranks sharing the data (the dp degree, not
            necessarily the world size).
        rank: this rank's index among them, in [0, num_replicas).
        seed: the shuffle seed; must be the same on every rank. Epoch e uses seed + e.
        shuffle: False keeps the dataset order (every epoch the same).
        drop_last: True (default) drops the last < num_replicas items of each pass so every rank
            gets the same count; they come back, reshuffled, in later epochs. False pads the
            last round with items from the start of the pass, which are then seen twice.
    """

    def __init__(self, data: Sized | int, num_replicas: int, rank: int, seed: int = 0, *,
                 shuffle: bool = True, drop_last: bool = True):
        n = data if isinstance(data, int) else len(data)
        if n < 0:
            raise ValueError(f"dataset length must be >= 0, got {n}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.num_samples = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0
        """Items of the current epoch handed out so far, over all ranks: a prefix of its order."""

    # -- order ---------------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The global order of `epoch`: the same on every rank and for every num_replicas."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def _pass_indices(self) -> torch.Tensor:
        rest = self.epoch_order(self.epoch)[self.consumed:]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        elif len(rest) % self.num_replicas:
            pad = self.num_replicas - len(rest) % self.num_replicas
            rest = torch.cat([rest, rest.repeat(pad // len(rest) + 1)[:pad]])
        return rest[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        """Items this rank yields in the pass `iter()` would start now (the rest of the epoch)."""
        rest = max(self.num_samples - self.consumed, 0)
        if self.drop_last:
            return rest // self.num_replicas
        return -(-rest // self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        """The rest of the current epoch for this rank; its last item moves the sampler to the next epoch."""
        start = self.consumed
        for k, index in enumerate(self._pass_indices().tolist()):
            # Counted when handed out: all ranks hand out item k of a pass together.
            self.consumed = min(start + (k + 1) * self.num_replicas, self.num_samples)
            self._roll_if_done()
            yield index

    def _roll_if_done(self) -> None:
        """Move to the next epoch once the rest of this one gives this rank nothing more."""
        if self.num_samples >= self.num_replicas and len(self) == 0:
            self.epoch += 1
            self.consumed = 0

    def set_epoch(self, epoch: int) -> None:
        """For torch DistributedSampler compatibility; not needed, the epoch advances by itself.

        Calling it with the current epoch keeps the position (so a resumed run that calls
        set_epoch in its loop stays exact); another epoch starts that epoch from its beginning.
        """
        if epoch != self.epoch:
            self.epoch, self.consumed = int(epoch), 0

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int | bool]:
        """The exact position, valid for any num_replicas on load."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "consumed": self.consumed,
                "seed": self.seed, "num_replicas": self.num_replicas,
                "num_samples": self.num_samples, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`, saved with any num_replicas: the rest of its epoch is re-split here."""
        n = state.get("num_samples")
        if n != self.num_samples:
            raise DataError(f"the sampler state was saved for a dataset of {n} samples, but this one "
                            f"has {self.num_samples}; resume with the same data and seq_len")
        consumed, epoch = int(state["consumed"]), int(state["epoch"])
        if not 0 <= consumed <= self.num_samples or epoch < 0:
            raise DataError(f"sampler state has epoch {epoch}, consumed {consumed} (of {n}): not a "
                            "valid position")
        if state.get("shuffle", self.shuffle) != self.shuffle:
            raise DataError(f"the sampler state was saved with shuffle={state['shuffle']}, "
                            f"but this sampler has shuffle={self.shuffle}")
        if int(state.get("seed", self.seed)) != self.seed:
            log.warning("sampler: resuming with the saved seed %s instead of %s, to keep the data order",
                        state["seed"], self.seed)
            self.seed = int(state["seed"])
        saved_r = state.get("num_replicas", self.num_replicas)
        if saved_r != self.num_replicas:
            log.info("sampler: resuming epoch %d at %d/%d consumed, re-split from %s to %d ranks",
                     epoch, consumed, n, saved_r, self.num_replicas)
        self.epoch, self.consumed = epoch, consumed
        self._roll_if_done()

    def __repr__(self) -> str:
        return (f"ResumableDistributedSampler(num_samples={self.num_samples}, rank={self.rank}/"
                f"{self.num_replicas}, seed={self.seed}, epoch={self.epoch}, consumed={self.consumed})")
