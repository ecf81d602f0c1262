"""The run-directory lock and the append-only checks of a start, in one process on real files."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from meshrun.checkpoint import manifest as mf
from meshrun.config import load_config
from meshrun.config.dump import save_config
from meshrun.errors import ConfigError
from meshrun.metrics.logger import MetricsLogger
from meshrun.rundir.history import plan_start, saved_form
from meshrun.rundir.lock import LOCK_FILE, RunDirBusy, RunLock, create_unique
from meshrun.rundir.runs import claim_unfinished_run, finished_step, write_finished


def test_one_holder_names_itself_and_a_dead_holder_is_taken_over(tmp_path, capsys):
    held = RunLock.acquire(tmp_path)
    with pytest.raises(RunDirBusy, match=f"in use by another meshrun train \\(pid {os.getpid()} on "
                                         f"{socket.gethostname()} since 20"):
        RunLock.acquire(tmp_path)  # another open file description: flock refuses it, even in one process
    held.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean release is not a death
    RunLock.acquire(tmp_path).release()
    assert "taking over" not in capsys.readouterr().err
    (tmp_path / LOCK_FILE).write_text('{"pid": 4242, "host": "node7", "since": 0}')  # killed: no release
    with RunLock.acquire(tmp_path):
        assert "taking over the lock of" in capsys.readouterr().err
        assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()


def test_the_launchers_of_one_multi_node_job_share_the_lock(tmp_path):
    node_a = RunLock.acquire(tmp_path, job="10.0.0.1:29400|job42")
    node_b = RunLock.acquire(tmp_path, job="10.0.0.1:29400|job42")  # every node runs `meshrun train`
    for other in (None, "10.0.0.1:29400|job43"):  # a single-node run, another multi-node job
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()}"):
            RunLock.acquire(tmp_path, job=other)
    node_a.release()
    assert "job42" in (tmp_path / LOCK_FILE).read_text()  # node b still runs
    node_b.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""
    with RunLock.acquire(tmp_path):
        with pytest.raises(RunDirBusy):
            RunLock.acquire(tmp_path, job="10.0.0.1:29400|job42")


def test_unnamed_runs_get_their_own_directories(tmp_path):
    first, second = create_unique(tmp_path, "20260101-000000"), create_unique(tmp_path, "20260101-000000")
    assert (first.name, second.name) == ("20260101-000000", "20260101-000000-2")


def _cfg(tmp_path, *overrides: str):
    return load_config(None, [f"train.run_dir={tmp_path}", "train.name=r", "train.steps=8", *overrides])


def _run(tmp_path, *, ckpts=(), finished=None):
    run = tmp_path / "r"
    save_config(saved_form(_cfg(tmp_path)), run / "config.toml")
    for step in ckpts:
        (mf.checkpoints_dir(run) / mf.step_dir_name(step)).mkdir(parents=True)
    if finished is not None:
        (run / "model.pt").write_bytes(b"weights")
        write_finished(run, finished)
    return run


def test_a_changed_config_is_refused_unless_forced_and_the_old_one_kept(tmp_path):
    run = _run(tmp_path, ckpts=[4])
    old = (run / "config.toml").read_bytes()
    same = plan_start(run, _cfg(tmp_path, "launch.nproc_per_node=4", "checkpoint.resume=auto"), force=False)
    assert not same.write_config and same.resume == "auto"  # per-start keys are no change
    with pytest.raises(ConfigError, match=r"this start differs: optim.lr=0.5 \(was 0.001\).*add --force"):
        plan_start(run, _cfg(tmp_path, "optim.lr=0.5"), force=False)
    assert (run / "config.toml").read_bytes() == old
    assert plan_start(run, _cfg(tmp_path, "optim.lr=0.5"), force=True).write_config
    (kept,) = run.glob("config.before-*.toml")
    assert kept.read_bytes() == old


def test_beyond_the_end_and_starting_over_need_force(tmp_path):
    run = _run(tmp_path, ckpts=[4, 8, 12])
    with pytest.raises(ConfigError, match="step-00000012 is beyond train.steps=8.*roll back to step-00000008"):
        plan_start(run, _cfg(tmp_path), force=False)
    assert plan_start(run, _cfg(tmp_path), force=True).resume == str(mf.checkpoints_dir(run) / "step-00000008")
    with pytest.raises(ConfigError, match="--resume never starts .* over: its checkpoints step-00000012"):
        plan_start(run, _cfg(tmp_path, "train.steps=12", "checkpoint.resume=never"), force=False)
    assert [p.name for p in mf.committed(mf.checkpoints_dir(run))] == ["step-00000012", "step-00000008",
                                                                       "step-00000004"]


def test_a_finished_run_is_done_and_more_steps_keep_its_weights(tmp_path):
    run = _run(tmp_path, ckpts=[8], finished=8)
    assert finished_step(run) == 8
    assert "finished at step 8" in plan_start(run, _cfg(tmp_path), force=True).finished  # nothing to force
    with pytest.raises(ConfigError, match="finished at step 8; training it again .train.steps=20"):
        plan_start(run, _cfg(tmp_path, "train.steps=20"), force=False)
    assert (run / "model.pt").read_bytes() == b"weights"
    plan_start(run, _cfg(tmp_path, "train.steps=20"), force=True)
    assert (run / "model.step-00000008.pt").read_bytes() == b"weights" and finished_step(run) is None
    (run / "model.pt").write_bytes(b"no marker")  # an older meshrun's finished run: finished, step unknown
    assert finished_step(run) == -1


def test_an_unnamed_run_never_continues_a_run_another_one_holds(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}", "train.steps=8"])
    run = tmp_path / "20260101-000000"
    save_config(saved_form(cfg), run / "config.toml")
    (mf.checkpoints_dir(run) / mf.step_dir_name(4)).mkdir(parents=True)
    with RunLock.acquire(run):
        assert claim_unfinished_run(cfg) is None  # a live run is continuing it already
    claimed, lock = claim_unfinished_run(cfg)
    lock.release()
    assert claimed == run


def test_metrics_rows_are_only_ever_appended(tmp_path):
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as metrics:
        metrics.log_eval(8, eval_loss=1.0)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as metrics:  # a resumed run
        metrics.log_eval(8, eval_loss=2.0)
    after = (tmp_path / "metrics.jsonl").read_bytes()
    assert after.startswith(before) and after.count(b'"eval"') == 2


def test_recording_settings_may_change_between_starts_the_training_ones_may_not():
    import dataclasses

    from meshrun.config import load_config
    from meshrun.rundir.history import first_difference

    saved = load_config(None, [])
    more = dataclasses.replace(saved, metrics=dataclasses.replace(saved.metrics, trackers="tensorboard", interval=3))
    assert first_difference(saved, more) is None  # adding a tracker on resume needs no --force
    snaps = dataclasses.replace(saved, checkpoint=dataclasses.replace(saved.checkpoint, snapshot_interval=1))
    assert first_difference(saved, snaps) is None  # memory snapshots do not change the weights either
    lr = dataclasses.replace(saved, optim=dataclasses.replace(saved.optim, lr=saved.optim.lr * 2))
    assert first_difference(saved, lr).startswith("optim.lr=")


def test_resume_by_step_names_a_checkpoint_of_the_named_run(tmp_path, monkeypatch):
    from meshrun.checkpoint.selection import resume_by_step
    from meshrun.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "exp"
    want = str(run / "checkpoints" / "step-00000010")
    with pytest.raises(ConfigError, match=r"--resume 10: run .*exp has no checkpoint at step 10 \(it has no checkpoint yet"):
        resume_by_step("10", run)
    Path(want).mkdir(parents=True)
    (run / "checkpoints" / "step-00000020").mkdir()
    with pytest.raises(ConfigError, match=r"--resume step-15: .* at step 15 \(its checkpoints: step-00000010, step-00000020; "
                                          r"see `meshrun ckpt list .*exp`\)"):
        resume_by_step("step-15", run)
    assert resume_by_step("step-00000010", run) == resume_by_step("step-10", run) == resume_by_step("10", run) == want
    assert resume_by_step("runs/other/checkpoints/step-00000004", run) == "runs/other/checkpoints/step-00000004"
    (tmp_path / "10").mkdir()  # a directory of that name where the command runs is a path, as given
    assert resume_by_step("10", run) == "10"
    with pytest.raises(ConfigError, match=r"--resume 12: a step names a checkpoint of a named run; add --set train.name"):
        resume_by_step("12", None)
