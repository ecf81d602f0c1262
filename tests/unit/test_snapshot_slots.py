"""Per-step snapshot slots and peer copies, in one process: exact, never torn, the right holder chosen."""

from __future__ import annotations

import torch

from meshrun.checkpoint.snapshot import Snapshots
from meshrun.checkpoint.snapshot_area import ENV
from meshrun.checkpoint.snapshot_peer import choose, holdings
from meshrun.checkpoint.snapshot_slots import SLOTS, SlotWriter, peek_slot, read_slot, resolve
from meshrun.checkpoint.state import TrainState
from meshrun.launch.rdzv_defaults import with_rdzv_defaults
from meshrun.runtime.process import DistEnv


class _Loader:
    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"epoch": 0, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return TrainState([model], [opt], [sched], _Loader())


def _step(state: TrainState) -> None:
    model, opt = state.model_parts[0], state.optimizers[0]
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    state.schedulers[0].step()
    state.train_loader.consumed += 3
    state.step += 1


class _Cfg:
    snapshot_interval = 1


ENV1 = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")


def test_slots_follow_training_and_resume_bitwise(tmp_path, monkeypatch):
    """Resolved once, each write copies the live tensors; a fresh state loaded from the newest slot
    continues exactly like the live one (weights, moments, LR, data position, RNG)."""
    monkeypatch.setenv(ENV, str(tmp_path))
    live = _state(0)
    _step(live)
    snaps = Snapshots(_Cfg(), run_dir=tmp_path, env=ENV1, layout={"strategy": "ddp"})
    for _ in range(3):
        snaps.step_done(live)
        _step(live)
    snaps.step_done(live)
    assert snaps.slots is not None and snaps.written >= 3
    other = _state(1)
    _step(other)
    resumed = Snapshots(_Cfg(), run_dir=tmp_path, env=ENV1, layout={"strategy": "ddp"})
    assert resumed.resume(other, disk=None, load_disk=None) == "snapshot" and other.step == live.step
    rng = torch.get_rng_state()  # one process: the RNG the snapshot restored serves both steps
    _step(live)
    torch.set_rng_state(rng)
    _step(other)
    for a, b in zip(live.model_parts[0].parameters(), other.model_parts[0].parameters(), strict=True):
        assert torch.equal(a, b)
    assert other.optimizers[0].param_groups[0]["lr"] == live.optimizers[0].param_groups[0]["lr"]
    assert other.train_loader.consumed == live.train_loader.consumed


def test_a_kill_mid_copy_leaves_the_other_slot_whole(tmp_path):
    state = _state(0)
    _step(state)
    writer = SlotWriter(tmp_path, resolve(state), {"rank": 0})
    small = {"train": {"step": 1}, "rng": {"python": [3, [1, 2], None]}}
    writer.write(1, small)
    _step(state)
    writer.write(2, small)
    assert [peek_slot(tmp_path / n)[0] for n in SLOTS] == [1, 2]
    # a write of step 3 into slot 0 killed after the commit record was zeroed and half the copy done
    commit = writer.commit_offset
    writer.maps[0][commit:commit + 12] = bytes(12)
    writer.targets[0][0].fill_(123.0)
    assert peek_slot(tmp_path / SLOTS[0]) is None and read_slot(tmp_path / SLOTS[0]) is None
    step, tree, meta = read_slot(tmp_path / SLOTS[1])
    assert step == 2 and meta == {"rank": 0}
    assert torch.equal(tree["tensors"]["model"]["0.weight"], state.model_parts[0][0].weight)
    data = bytearray((tmp_path / SLOTS[1]).read_bytes())
    data[30] ^= 1  # the static header
    assert read_slot(data) is None and read_slot(bytes(data[:-1])) is None


def test_peer_holdings_and_the_agreed_step(tmp_path):
    """Rank 1's host is gone: its state at the newest step every rank is held at comes from rank 0's area."""
    state = _state(0)
    _step(state)
    meta = {"world_size": 2, "rank": 1, "layout": {}, "config_sha256": "x"}
    peer = tmp_path / "peer-rank1"
    writer = SlotWriter(peer, resolve(state), meta)
    writer.write(7, {"train": {}, "rng": {"python": [3, [], None]}})
    writer.write(8, {"train": {}, "rng": {"python": [3, [], None]}})
    (peer / f"{SLOTS[0]}.ok").touch()  # slot 1's transfer never finished: no marker, not a copy
    held = holdings(tmp_path, {**meta, "rank": 0})
    assert [(r, s) for r, s, _, _ in held] == [(1, 7)]
    assert holdings(tmp_path, {**meta, "rank": 0, "world_size": 4}) == []  # another setup's copy
    best, fetch = choose([held, []], 2, [{6, 7, 8}, set()])
    assert best == 7 and fetch == {1: (0, held[0][2], held[0][3])}
    assert choose([[], []], 2, [{7}, set()]) == (None, {})
    assert choose([[], []], 2, [{5, 7}, {7, 8}])[0] == 7
    # the lost host's replacement is rank 0 (the rendezvous orders agents by pid): the surviving
    # host, now rank 1, holds its old rank 0's slot and rank 1's copy; rank 0 fetches from it
    survivor = [(0, 7, 100, "/a/rank0"), (1, 7, 100, "/a/peer-rank1")]
    assert choose([[], survivor], 2, [set(), {7}]) == (7, {0: (1, 100, "/a/rank0")})


def test_rendezvous_defaults_only_where_unset_and_only_across_nodes():
    assert with_rdzv_defaults("", backend="c10d", max_nodes=2) == \
        "keep_alive_interval=1,keep_alive_max_attempt=5,last_call_timeout=2"
    assert with_rdzv_defaults("keep_alive_interval=3,is_host=1", backend="c10d", max_nodes=2) == \
        "keep_alive_interval=3,is_host=1,keep_alive_max_attempt=5,last_call_timeout=2"
    assert with_rdzv_defaults("join_timeout=9", backend="c10d", max_nodes=1) == "join_timeout=9"
    assert with_rdzv_defaults(None, backend="static", max_nodes=2) == ""


def test_a_restarted_writer_keeps_its_predecessors_older_slots(tmp_path):
    """Resumed at step 2: the slot of step 2 stays whole until overwritten, one of step 3 (another timeline) does not."""
    state = _state(0)
    _step(state)
    small = {"train": {}, "rng": {"python": [3, [], None]}}
    first = SlotWriter(tmp_path, resolve(state), {"rank": 0})
    first.write(2, small)
    first.write(3, small)
    again = SlotWriter(tmp_path, resolve(state), {"rank": 0}, step=2)
    assert again.steps == [2, None] and again.next == 1
    assert [None if peek_slot(tmp_path / n) is None else peek_slot(tmp_path / n)[0] for n in SLOTS] == [2, None]
    again.write(3, small)
    assert again.next == 0 and [peek_slot(tmp_path / n)[0] for n in SLOTS] == [2, 3]
