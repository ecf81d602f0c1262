"""A worker of one replica group under torchft's Manager: the trainer's hook in torchft mode.

    steps = attach(cfg, env, layout, state)          # train/trainer.py, after the resume
    for step in steps.steps(state, cfg.train.steps, metrics):
        ...; steps.step_done(checkpointer, state)    # the checkpointer's end of the step

meshrun.fault.worker hands `attach` to the trainer (its StepSource factory); exact mode never
imports this module. meshrun.fault.launch started this group with REPLICA_GROUP_ID,
NUM_REPLICA_GROUPS and TORCHFT_LIGHTHOUSE; the `Replica` `attach` returns, before each step:

1. forms a quorum with the other groups (synchronously: `use_async_quorum=False`, so a heal is
   applied between steps, on this thread, never under a running step);
2. heals when this group is behind: the peer's model, optimizer, LR schedule, data position and
   step, over torchft's HTTP transport, read back weights-only (never a full unpickle);
3. re-splits the data among the groups in the quorum: the sampler's position is global
   (meshrun.data.sampler), so a step with fewer groups takes the next samples among fewer ranks
   and nothing a missing group would have read is skipped;

and after it: a step the groups did not commit (torchft's `should_commit` said no, e.g. a peer
died mid all-reduce) is rolled back (data position, LR schedule and the lr it set, step) and run
again; a committed one goes to the checkpointer (`step_done`: interval and SIGTERM saves) and to the
ledger (ledger.py); an uncommitted one reaches neither. Gradients are averaged within the group
(the default process group) and then across the groups (torchft's reconfigurable gloo group,
through its DDP comm hook; HSDP groups, FSDP inside: through FSDP's all-reduce hook, hsdp.py).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshrun.fault import hsdp, ledger
from meshrun.fault.settings import (
    GROUP_ENV,
    LIGHTHOUSE_ENV,
    NUM_GROUPS_ENV,
    RECORDS_ENV,
)
from meshrun.runtime.process import phase

logger = logging.getLogger(__name__)


def attach(cfg, env, layout, state) -> Replica:
    """This worker's Replica (wraps the model and optimizer in place): the trainer's step source
    in torchft mode (train/trainer.py's StepSource), handed over by meshrun.fault.worker."""
    return Replica(cfg.fault, env, layout, state)


class CommitOptimizer(torch.optim.Optimizer):
    """Steps the optimizer only when every group in the quorum agrees to commit this step."""

    def __init__(self, manager, optimizer: torch.optim.Optimizer):  # no super().__init__: a wrapper, as torchft.optim
        self.manager, self.inner, self.committed = manager, optimizer, False
        self.optimizers = getattr(optimizer, "optimizers", [optimizer])  # what checkpoints save (state.py)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def step(self, closure=None) -> None:
        assert closure is None, "closures are not supported under torchft"
        self.committed = self.manager.should_commit()
        if self.committed:
            self.inner.step()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)


def _group_ddp(manager, module: nn.Module, group_world: int) -> nn.Module:
    """torchft's DDP (gradients averaged across groups in its comm hook), averaging within the
    group first when the group has several processes."""
    from torchft.ddp import DistributedDataParallel

    class GroupDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            if group_world > 1:
                dist.all_reduce(bucket.buffer())  # the group's default process group, synchronous
                bucket.buffer().div_(group_world)
            return DistributedDataParallel._comm_hook(state, bucket)

    return GroupDDP(manager, module)


def _weights_only_transport(timeout: timedelta):
    """torchft's HTTP checkpoint transport, reading a peer's state weights-only: the peer's bytes
    are data, never code (torchft's own reader unpickles them fully)."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


class Replica:
    """This worker's Manager, and the steps of a torchft run (see the module doc)."""
    sharded = False  # FSDP inside the group (HSDP, hsdp.py); __init__ sets it

    def __init__(self, fault, env, layout, state):
        from torchft import Manager, ProcessGroupGloo

        self.group = int(os.environ[GROUP_ENV])
        self.num_groups = int(os.environ[NUM_GROUPS_ENV])
        self.records = Path(os.environ[RECORDS_ENV])
        self.writer = env.rank == 0  # the group's local rank 0 writes its ledger and events
        self.group_size, self.local_rank = env.world_size, env.rank
        timeout = timedelta(seconds=fault.timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
            min_replica_size=fault.min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=fault.quorum_timeout_s), connect_timeout=timeout,
            rank=env.rank, world_size=env.world_size, replica_id=f"meshrun_{self.group}",
            lighthouse_addr=os.environ[LIGHTHOUSE_ENV], init_sync=False,  # every group seeds alike
            checkpoint_transport=_weights_only_transport(timeout))
        self.manager.load_state_dict({"step": state.step, "batches_committed": 0})
        self.manager.register_state_dict_fn("meshrun", self._load_state, self._state)
        part = layout.parts[0]
        self.module = part.module if isinstance(part, nn.parallel.DistributedDataParallel) else part
        self.sharded = hsdp.is_sharded(part)  # HSDP: FSDP inside the group, torchft across (hsdp.py)
        if self.sharded:
            hsdp.attach(self.manager, part)
        else:  # DDP inside the group
            layout.parts[0] = _group_ddp(self.manager, self.module, env.world_size)
        self.optimizer = CommitOptimizer(self.manager, state.optimizers[0])
        state.optimizers[0] = self.optimizer
        self.state = state
        self.heals = self.commits = self.retries = self.quorums = 0
        self._healed_from: int | None = None
        self._quorum_size = None
        self._fingerprint_next = True  # the first commit after a quorum change records the weights' sum
        if self.writer:
            self.records.mkdir(parents=True, exist_ok=True)
            ledger.record_event(self.records, "start", group=self.group, step=state.step)

    # -- the state a recovering peer receives ------------------------------------------------

    def _state(self) -> dict:
        s = self.state  # HSDP: rank i's shards, for the healing group's rank i (hsdp.py)
        return {**hsdp.model_state(self.module, self.optimizer.inner, self.sharded),
                "scheduler": s.schedulers[0].state_dict(), "data": s.train_loader.state_dict(),
                "step": s.step}

    def _load_state(self, saved: dict) -> None:
        s = self.state
        self._healed_from = s.step
        hsdp.load_model_state(self.module, self.optimizer.inner, saved, self.sharded)
        for scheduler in s.schedulers:
            scheduler.load_state_dict(saved["scheduler"])
        s.train_loader.load_state_dict(saved["data"])
        s.step = int(saved["step"])

    # -- the loop -----------------------------------------------------------------------------

    def step_done(self, checkpointer, state) -> None:
        """The checkpointer's end of a step (interval save, SIGTERM save), for committed steps only.

        A step the quorum did not commit is rolled back and run again (`steps`): saved now, its
        checkpoint would hold the step number, data position and LR schedule of a step whose
        optimizer update never happened, and the retry, at the same step, would not save again.
        Every rank of the quorum gets the same answer from should_commit, so the collectives in
        step_done (the SIGTERM agreement) are skipped by all of the group or none."""
        if self.optimizer.committed:
            checkpointer.step_done(state)

    def steps(self, state, total: int, metrics=None):
        """The steps to run: each after a quorum (and a heal if behind), each again if not committed."""
        loader, schedulers = state.train_loader, state.schedulers
        try:
            while state.step < total:
                started = time.time()
                with phase("torchft quorum"):  # waits for the other groups, heals: not a step
                    self.manager.start_quorum()
                self._after_quorum(state, metrics, started)
                if self._finished_elsewhere(state.step, total):
                    return  # the trainer sees state.step < total: no final weights from this group
                before, schedule = loader.state_dict(), schedule_state(schedulers)
                yield state.step + 1
                if self.optimizer.committed:
                    self.commits += 1
                    self._write_row(state.step, before, loader.state_dict())
                else:  # run the same step again, on the same data, at the same learning rate
                    self.retries += 1
                    loader.load_state_dict(before)
                    restore_schedule(schedulers, schedule)
                    state.step -= 1
            if metrics is not None:
                metrics.log_meta(event="torchft", group=self.group, heals=self.heals, commits=self.commits,
                                 retries=self.retries, quorum_changes=self.quorums)
            if self.writer:
                ledger.record_event(self.records, "done", group=self.group, step=state.step, heals=self.heals,
                                    commits=self.commits, retries=self.retries)
        finally:
            self.manager.shutdown(wait=False)

    def _after_quorum(self, state, metrics, started: float) -> None:
        """Count a heal, re-split the data for this quorum, and record a change of quorum."""
        size = self.manager.num_participants()
        rank = self.manager.participating_rank()
        assert rank is not None, "a synchronous quorum always includes this group"
        healed, self._healed_from = self._healed_from, None
        if healed is not None:
            self.heals += 1
            if self.writer:
                ledger.record_event(self.records, "heal", group=self.group, from_step=healed, to_step=state.step,
                                    seconds=round(time.time() - started, 4))
        self._resplit(state.train_loader, size * self.group_size, rank * self.group_size + self.local_rank)
        # A new quorum: its size changed, this group healed, or its members did (a replacement joined
        # while this group's quorum never shrank: torchft's quorum id, private, read where it exists).
        quorum = (size, getattr(self.manager, "_quorum_id", None))
        if quorum != self._quorum_size or healed is not None:
            self.quorums += 1
            self._fingerprint_next = True
            self._quorum_size = quorum
            if metrics is not None:
                metrics.log_meta(event="torchft_quorum", step=state.step + 1, group=self.group, quorum_size=size,
                                 participating_rank=rank, healed=healed is not None, heals=self.heals)

    def _finished_elsewhere(self, step: int, total: int) -> bool:
        """Whether groups missing from this quorum finished the run (their "done" at `total`, since
        this job's launch) while this one was away. Nobody is left to heal from: stepping on alone,
        from `step`, would be a second lineage whose weights differ from the run's result. Every
        rank of the group decides alike (the quorum is the group's; a rank that reads the events
        first must not step alone)."""
        if self.manager.num_participants() >= self.num_groups:
            return False
        events = ledger.read_events(self.records)
        since = max((e["time"] for e in events if e["event"] == "launch"), default=0.0)
        done = [e for e in events if e["event"] == "done" and e["group"] != self.group and e["time"] >= since
                and e["step"] >= total]
        if self.group_size > 1:
            flag = torch.tensor([1.0 if done else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            finished = bool(flag.item())
        else:
            finished = bool(done)
        if finished and self.writer:
            by = sorted({e["group"] for e in done})  # the worker says so (train/worker.py)
            ledger.record_event(self.records, "ended", group=self.group, step=step, finished_by=by)
        return finished

    @staticmethod
    def _resplit(loader, num_replicas: int, rank: int) -> None:
        """Give this rank its share of the rest of the epoch among `num_replicas` ranks."""
        sampler = loader.sampler
        if (sampler.num_replicas, sampler.rank) == (num_replicas, rank):
            return
        position = loader.state_dict()
        sampler.num_replicas, sampler.rank = num_replicas, rank
        loader.load_state_dict(position)

    def _write_row(self, step: int, before: dict, after: dict) -> None:
        fingerprint = None  # groups in one quorum hold equal weights: the rows of a step must agree
        if self._fingerprint_next and (self.sharded or self.writer):  # sharded: a collective, every rank
            fingerprint = (hsdp.weights_sum if self.sharded else weights_sum)(self.module)
        self._fingerprint_next = False
        if not self.writer:
            return
        row = {"step": step, "group": self.group, "pid": os.getpid(), "time": round(time.time(), 4),
               "participants": self.manager.num_participants(), "epoch0": before["epoch"], "pos0": before["consumed"],
               "epoch1": after["epoch"], "pos1": after["consumed"], "epoch_end": before["num_samples"]}
        if after["epoch"] != before["epoch"]:  # past the epoch's end: where its samples stopped
            row["end0"] = ledger.epoch_end_taken(before, self.state.train_loader.dataloader.batch_size)
        if fingerprint is not None:
            row["weights_sum"] = fingerprint
        ledger.append_row(ledger.ledger_path(self.records, self.group), row)


def schedule_state(schedulers) -> list[tuple[dict, list[dict]]]:
    """What `restore_schedule` needs to run a step again at the same learning rate: each scheduler's
    state and its optimizer's hyperparameters (every param_group key but the params)."""
    return [(s.state_dict(), [copy.deepcopy({k: v for k, v in g.items() if k != "params"})
                              for g in s.optimizer.param_groups]) for s in schedulers]


def restore_schedule(schedulers, saved: list[tuple[dict, list[dict]]]) -> None:
    """Undo the schedulers' step: torch's `load_state_dict` restores a scheduler's counter but
    not the lr it already wrote into the optimizer's param_groups, so those are put back too."""
    for scheduler, (state, groups) in zip(schedulers, saved, strict=True):
        scheduler.load_state_dict(state)
        for group, hyper in zip(scheduler.optimizer.param_groups, groups, strict=True):
            group.update(copy.deepcopy(hyper))


@torch.no_grad()
def weights_sum(module: nn.Module) -> float:
    """A fingerprint of the weights: the float64 sum of every parameter and buffer."""
    return float(sum(t.detach().double().sum() for t in module.state_dict().values() if t.is_floating_point()))
