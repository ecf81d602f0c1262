"""torchft mode, in-process: the [fault] keys and the pre-launch rules (one line, exit 2), and the
data ledger's accounting of which samples the committed steps consumed."""

from __future__ import annotations

import pytest
from conftest import TINY, meshrun

from meshrun.config import load_config
from meshrun.errors import ConfigError
from meshrun.fault import ledger
from meshrun.train.preflight import check_fault


@pytest.mark.parametrize(("overrides", "message"), [
    (["fault.mode=elastic"], "fault.mode must be one of 'exact', 'torchft', got 'elastic'"),
    (["fault.replica_groups=0"], "fault.replica_groups must be >= 1, got 0"),
    (["fault.min_replicas=3"], "fault.min_replicas must be <= fault.replica_groups (2), got 3"),
    (["fault.timeout_s=0"], "fault.timeout_s must be > 0 seconds, got 0.0"),
])
def test_fault_keys_are_checked(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        load_config(None, overrides)


@pytest.mark.parametrize(("overrides", "nnodes", "fix"), [
    (["parallel.strategy=fsdp", "parallel.tp=2"], "1", "got parallel.tp = 2; set parallel.tp = 1, or fault.mode = 'exact'"),
    (["parallel.strategy=fsdp", "parallel.pp=2"], "1", "got parallel.pp = 2; set parallel.pp = 1"),
    (["train.dtype=fp16"], "1", "does not take train.dtype = 'fp16'"),
    ([], "1:2", "on one host for now, got --nnodes 1:2"),
])
def test_torchft_rules(overrides, nnodes, fix):
    cfg = load_config(None, ["fault.mode=torchft", *overrides])
    with pytest.raises(ConfigError, match="fault.mode = 'torchft'") as info:
        check_fault(cfg, nnodes=nnodes)
    assert fix in str(info.value) and "\n" not in str(info.value)
    check_fault(load_config(None, overrides), nnodes=nnodes)  # exact mode: no rule of torchft's applies


def test_missing_extra_is_one_line_before_launch(tmp_path):
    """Without torchft installed (hidden here by a sitecustomize that blocks its import), `meshrun train`
    names the extra in one line and exits 2, before anything starts."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("import sys\nsys.modules['torchft'] = None  # as if not installed\n")
    result = meshrun("train", TINY, "--set", "fault.mode=torchft", "--set", f"train.run_dir={tmp_path}",
                     env={"PYTHONPATH": str(shadow)}, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "meshrun train: error: fault.mode = 'torchft' needs torchft: pip install 'meshrun[torchft]'")
    assert not any(tmp_path.glob("2*")), "a run directory was created"


def _row(step, group, pos0, pos1, *, participants=2, time=None, epoch=0, **extra):
    return {"step": step, "group": group, "pid": 1, "time": time if time is not None else float(step),
            "participants": participants, "epoch0": epoch, "pos0": pos0, "epoch1": epoch, "pos1": pos1,
            "epoch_end": 1000, **extra}


def test_ledger_exact_when_the_steps_tile_the_epoch():
    rows = [_row(1, 0, 0, 16), _row(1, 1, 0, 16), _row(2, 0, 16, 24, participants=1),  # group 1 away
            _row(3, 0, 24, 40, weights_sum=1.5), _row(3, 1, 24, 40, weights_sum=1.5)]  # healed: equal weights
    acc = ledger.account(rows, num_groups=2)
    assert acc.exact and acc.steps == 3 and acc.samples == 40 and acc.covered == {0: 40}
    assert acc.alone == {0: 1} and acc.by_group == {0: 3, 1: 2}
    assert acc.weights_compared == 1 and not acc.weights_differ
    assert ledger.describe(acc).startswith("data: 3 committed steps consumed 40 samples, each exactly once")


def test_ledger_names_lost_and_doubled_samples_and_differing_weights():
    rows = [_row(1, 0, 0, 16), _row(2, 0, 24, 40), _row(3, 0, 32, 48, weights_sum=1.0),
            _row(3, 1, 32, 48, weights_sum=2.0)]
    acc = ledger.account(rows)
    assert acc.gaps == [(0, 16, 24)] and acc.overlaps == [(0, 32, 40)] and acc.weights_differ == [3]
    line = ledger.describe(acc)
    assert "never committed (lost): epoch 0 [16, 24)" in line and "committed twice: epoch 0 [32, 40)" in line
    assert "weights DIFFER across groups at steps [3]" in line


def test_ledger_keeps_the_lineage_that_continued():
    """Group 1 committed step 2 with both groups and died; group 0 had not, and committed step 2
    again alone: the later row is the one step 3 builds on, so nothing is counted twice."""
    rows = [_row(1, 0, 0, 16), _row(2, 1, 16, 32, time=2.0), _row(2, 0, 16, 24, participants=1, time=3.0),
            _row(3, 0, 24, 32, participants=1, time=4.0)]
    acc = ledger.account(rows, num_groups=2)
    assert acc.exact and acc.superseded == 1 and acc.covered == {0: 32}


def test_ledger_discards_what_a_process_committed_before_it_healed():
    """Seen under load: group 0 committed steps 1-2 with group 1 (both halves of [0, 32)), then
    alone; group 1's replacement (pid 7), while group 0's heartbeat had lapsed, formed a quorum
    by itself, committed steps 1-2 from scratch on [0, 16) with other weights, then healed to step
    4. Those two rows are a thrown-away lineage: they neither supersede group 0's (which would
    leave [16, 32) lost) nor count as differing weights."""
    rows = [_row(1, 0, 0, 16, weights_sum=1.0), _row(2, 0, 16, 32), _row(3, 0, 32, 40, participants=1, time=3.0),
            _row(4, 0, 40, 48, participants=1, time=4.0), _row(5, 0, 48, 64, time=6.0, weights_sum=5.0)]
    lost = [_row(1, 1, 0, 8, participants=1, time=4.1, weights_sum=9.0) | {"pid": 7},
            _row(2, 1, 8, 16, participants=1, time=4.2) | {"pid": 7}]
    healed = [_row(5, 1, 48, 64, time=6.0, weights_sum=5.0) | {"pid": 7}]
    events = [{"event": "start", "group": 1, "pid": 7, "time": 4.0},
              {"event": "heal", "group": 1, "pid": 7, "time": 5.0, "from_step": 2, "to_step": 4}]
    acc = ledger.account(rows + lost + healed, num_groups=2, events=events)
    assert acc.exact and acc.covered == {0: 64} and acc.discarded == 2, ledger.describe(acc)
    assert acc.weights_compared == 1 and not acc.weights_differ
    assert acc.by_group == {0: 5, 1: 3}  # what each group committed, kept or not
    assert "2 step(s) a group committed before it healed from a peer, discarded" in ledger.describe(acc)
    without = ledger.account(rows + lost + healed, num_groups=2)  # the heal unknown: a gap and a false alarm
    assert without.gaps == [(0, 16, 32)] and without.weights_differ == [1]


def test_ledger_reads_rows_back_and_skips_a_torn_line(tmp_path):
    ledger.append_row(ledger.ledger_path(tmp_path, 0), _row(1, 0, 0, 8))
    with open(ledger.ledger_path(tmp_path, 0), "a") as fp:
        fp.write('{"step": 2, "gro')  # a writer killed mid-line
    ledger.record_event(tmp_path, "heal", group=1, from_step=0, to_step=5)
    assert [r["step"] for r in ledger.read_ledgers(tmp_path)] == [1]
    assert ledger.read_events(tmp_path)[0]["to_step"] == 5



def test_ledger_is_exact_at_an_epoch_boundary():
    """A step that runs past the end of epoch 0 (50 samples, 2 ranks, batches of 4, two batches a
    step): the real loaders take epoch 0's positions [40, 48) and epoch 1's [0, 8); [48, 50) fills
    no whole batch and is skipped in epoch 0. The row says so, and the ledger tiles exactly."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from meshrun.data.loader import InfiniteLoader
    from meshrun.data.sampler import ResumableDistributedSampler

    loaders = [InfiniteLoader(DataLoader(TensorDataset(torch.arange(50)), batch_size=4, drop_last=True,
                                         sampler=ResumableDistributedSampler(50, num_replicas=2, rank=r, seed=0)))
               for r in range(2)]
    for loader in loaders:
        loader.load_state_dict({**loader.state_dict(), "epoch": 0, "consumed": 40})
    before = loaders[0].state_dict()
    taken = [[next(loader)[0].tolist() for _ in range(2)] for loader in loaders]  # one step: 2 batches a rank
    after = loaders[0].state_dict()
    order = loaders[0].sampler
    assert sorted(taken[0][0] + taken[1][0]) == sorted(order.epoch_order(0)[40:48].tolist())
    assert sorted(taken[0][1] + taken[1][1]) == sorted(order.epoch_order(1)[0:8].tolist())
    assert (after["epoch"], after["consumed"]) == (1, 8)

    end0 = ledger.epoch_end_taken(before, batch_size=4)
    assert end0 == 48
    rows = [_row(1, 0, 0, 40), _row(2, 0, 40, 8, epoch_end=50, end0=end0) | {"epoch1": 1},
            _row(3, 0, 8, 24, epoch=1, epoch_end=50)]
    acc = ledger.account(rows)
    assert acc.exact and acc.samples == 48 + 24 and acc.covered == {0: 48, 1: 24}
    assert acc.dropped == [(0, 48, 50)]
    assert "skipped in it: epoch 0 [48, 50)" in ledger.describe(acc)
    # The same step as an older meshrun wrote it (no end0): the tail counts as taken, as before.
    assert ledger.account([rows[0], {k: v for k, v in rows[1].items() if k != "end0"}, rows[2]]).covered[0] == 50
