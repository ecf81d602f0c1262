"""ResumableDistributedSampler on 2 real gloo ranks: each epoch's indices, gathered, are disjoint and complete."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from meshrun.data import InfiniteLoader, ResumableDistributedSampler
from meshrun.testing import run_distributed

N, BATCH = 200, 4


def two_epochs_of_indices(seed: int) -> tuple[list, list]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = ResumableDistributedSampler(N, world, rank, seed)
    loader = InfiniteLoader(DataLoader(TensorDataset(torch.arange(N)), batch_size=BATCH,
                                       sampler=sampler, drop_last=True))
    per_epoch = N // world // BATCH
    mine = [[i for _ in range(per_epoch) for i in next(loader)[0].tolist()] for _epoch in range(2)]
    next(loader)  # one batch into epoch 2, so the states below are mid-epoch
    indices = [None] * world
    dist.all_gather_object(indices, mine)
    states = [None] * world
    dist.all_gather_object(states, loader.state_dict())
    return indices, states


def test_ranks_cover_each_epoch_exactly_once_and_reshuffle():
    results = run_distributed(two_epochs_of_indices, world_size=2, args=(7,), timeout=90)
    indices, states = results[0]
    assert results[1] == results[0]  # every rank gathered the same view
    for epoch in range(2):
        per_rank = [indices[r][epoch] for r in range(2)]
        assert not set(per_rank[0]) & set(per_rank[1])  # disjoint
        assert sorted(per_rank[0] + per_rank[1]) == list(range(N))  # complete
    assert indices[0][0] != indices[0][1]  # epoch 2's order differs, without set_epoch
    assert states[0] == states[1] and (states[0]["epoch"], states[0]["consumed"]) == (2, 2 * BATCH)
