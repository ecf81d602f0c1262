"""torchft mode: the run's model.pt comes from a group that finished, also when group 0 did not
(in-process, real files: what the launcher does after every group has ended)."""

from __future__ import annotations

from meshrun.fault import ledger
from meshrun.fault.launch import (
    final_weights_group,
    job_exit_code,
    publish_final_weights,
    summarize,
)
from meshrun.rundir.runs import finished_step, write_finished


def _finish(gdir, steps: int, weights: bytes) -> None:
    gdir.mkdir(parents=True, exist_ok=True)
    (gdir / "model.pt").write_bytes(weights)
    write_finished(gdir, steps)


def test_choice_prefers_group_0_then_the_lowest_group_that_finished():
    assert final_weights_group({0: 50, 1: 50, 2: 50}, 50) == 0
    assert final_weights_group({0: None, 1: None, 2: 50}, 50) == 2
    assert final_weights_group({0: None, 1: 50, 2: 50}, 50) == 1
    assert final_weights_group({0: 30, 1: None}, 50) is None  # finished at another step: not this run's end
    assert final_weights_group({0: None, 1: None}, 50) is None


def test_group_1_publishes_when_group_0_ran_out_of_restarts(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "torchft").mkdir(parents=True)
    _finish(run_dir / "replica-1", 50, b"group 1 weights")
    assert finished_step(run_dir) is None
    assert publish_final_weights(run_dir, 2, 50) == 1
    assert (run_dir / "model.pt").read_bytes() == b"group 1 weights" and finished_step(run_dir) == 50
    summary = summarize(run_dir / "torchft", 2, [1, 0], seconds=1.0, weights_by=1)
    assert summary["final_weights_group"] == 1
    assert summary["lines"][-1] == ("final weights model.pt written by group 1 (replica-1/model.pt; "
                                    "group 0 did not finish)")


def test_group_0_keeps_its_own_and_nothing_finished_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    _finish(run_dir, 50, b"group 0 weights")
    _finish(run_dir / "replica-1", 50, b"group 1 weights")
    assert publish_final_weights(run_dir, 2, 50) == 0
    assert (run_dir / "model.pt").read_bytes() == b"group 0 weights"
    empty = tmp_path / "empty"
    (empty / "torchft").mkdir(parents=True)
    assert publish_final_weights(empty, 2, 50) is None and not (empty / "model.pt").exists()
    assert summarize(empty / "torchft", 2, [1, 1], seconds=1.0)["lines"][-1] == (
        "final weights: none written, no group finished")


def test_the_job_succeeds_when_a_group_finished_the_run():
    assert job_exit_code([1, 0], None, 1) == 0  # group 0 ran out of restarts, group 1 finished: the run did
    assert job_exit_code([1, 1], None, None) == 1  # nobody finished: the first failure is the job's
    assert job_exit_code([0, 0], 15, 0) == 128 + 15  # stopped by SIGTERM: saved, to be re-run
    assert job_exit_code([0, 0], None, 0) == 0
    assert job_exit_code([0, 0], None, 0, diverged=True) == 1  # groups' weights differed at a step: broken


def test_a_group_that_stopped_because_the_others_finished_says_so(tmp_path):
    records = tmp_path / "torchft"
    records.mkdir()
    ledger.record_event(records, "launch", groups=2)
    ledger.record_event(records, "start", group=1, step=0)
    ledger.record_event(records, "ended", group=1, step=0, finished_by=[0])
    lines = summarize(records, 2, [0, 0], seconds=1.0)["lines"]
    assert lines[1].endswith("; stopped at step 0: group(s) [0] had finished the run"), lines
