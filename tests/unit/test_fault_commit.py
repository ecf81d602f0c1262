"""torchft mode, in-process: a step the quorum did not commit is rolled back and run again, and
neither the checkpointer (interval and SIGTERM saves) nor the data ledger ever sees it.

torchft's Manager is replaced by a scripted stand-in (its should_commit answers come from a
list); the data loader, sampler, LR schedule, optimizer and ledger files are the real ones."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from meshrun.data.loader import InfiniteLoader
from meshrun.data.sampler import ResumableDistributedSampler
from meshrun.fault import ledger
from meshrun.fault.replica import CommitOptimizer, Replica
from meshrun.train.trainer import ExactSteps


class ScriptedManager:
    """torchft.Manager's calls that Replica.steps makes, one group alone in its quorum."""

    def __init__(self, commits: list[bool]):
        self.commits = list(commits)

    def start_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return 1

    def participating_rank(self) -> int:
        return 0

    def should_commit(self) -> bool:
        return self.commits.pop(0)

    def shutdown(self, wait: bool = True) -> None:
        pass


class State:
    def __init__(self, optimizer, loader, scheduler):
        self.step, self.optimizers, self.train_loader, self.schedulers = 0, [optimizer], loader, [scheduler]


class RecordingCheckpointer:
    def __init__(self):
        self.seen: list[tuple[int, int, float]] = []

    def step_done(self, state) -> None:
        self.seen.append((state.step, state.train_loader.state_dict()["consumed"],
                          state.schedulers[0].get_last_lr()[0]))


def _replica(tmp_path, commits: list[bool]) -> tuple[Replica, State]:
    module = torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(module.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0 / (step + 1))
    sampler = ResumableDistributedSampler(64, num_replicas=1, rank=0, seed=0)
    loader = InfiniteLoader(DataLoader(TensorDataset(torch.arange(64)), batch_size=4, sampler=sampler, drop_last=True))
    replica = object.__new__(Replica)  # no Manager, no lighthouse: the fields Replica.__init__ sets
    manager = ScriptedManager(commits)
    replica.manager, replica.module, replica.optimizer = manager, module, CommitOptimizer(manager, inner)
    replica.group, replica.num_groups, replica.records, replica.writer = 0, 1, tmp_path, True
    replica.group_size, replica.local_rank = 1, 0
    replica.heals = replica.commits = replica.retries = replica.quorums = 0
    replica._healed_from, replica._quorum_size, replica._fingerprint_next = None, None, True
    state = State(replica.optimizer, loader, scheduler)
    replica.state = state
    return replica, state


def _train(replica, state, total: int, checkpointer) -> list[tuple[int, float]]:
    """The trainer's loop (train/trainer.py) as far as torchft is concerned; (step, the lr its
    optimizer step ran at) for every attempt."""
    used = []
    for step in replica.steps(state, total):
        next(state.train_loader)
        used.append((step, state.optimizers[0].param_groups[0]["lr"]))
        state.optimizers[0].step()  # CommitOptimizer: asks the quorum, steps only if committed
        for scheduler in state.schedulers:
            scheduler.step()
        state.step = step
        replica.step_done(checkpointer, state)
    return used


def test_an_uncommitted_step_is_neither_checkpointed_nor_ledgered(tmp_path):
    replica, state = _replica(tmp_path, [True, False, True, True, True])
    checkpointer = RecordingCheckpointer()
    used = _train(replica, state, 4, checkpointer)
    assert replica.retries == 1 and replica.commits == 4
    # The retry of step 2 runs at step 2's lr, not step 3's: the scheduler's state is rolled back,
    # and so is the lr it had written into the optimizer (torch's load_state_dict leaves that one).
    assert used == [(1, 1.0), (2, 1 / 2), (2, 1 / 2), (3, 1 / 3), (4, 1 / 4)]
    # Step 2 failed once: the checkpointer saw it once, after its retry, at the data position and LR
    # of one step past step 1 (the failed attempt's position 8 and LR were rolled back, not doubled).
    assert checkpointer.seen == [(1, 4, 1 / 2), (2, 8, 1 / 3), (3, 12, 1 / 4), (4, 16, 1 / 5)]
    rows = ledger.read_ledgers(tmp_path)
    assert [(r["step"], r["pos0"], r["pos1"]) for r in rows] == [(1, 0, 4), (2, 4, 8), (3, 8, 12), (4, 12, 16)]
    assert ledger.account(rows, 1).exact


def test_exact_mode_checkpoints_every_step(tmp_path):
    _replica_unused, state = _replica(tmp_path, [])
    checkpointer = RecordingCheckpointer()
    state.step = 3
    ExactSteps().step_done(checkpointer, state)
    assert checkpointer.seen == [(3, 0, 1.0)]
