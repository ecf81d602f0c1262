"""One owner per run directory, and a run's history is append-only: real `meshrun train` processes, real files.

One run trains (1 process, 12 steps). While it holds its directory, a second `meshrun train` of
the same name is refused; afterwards the finished run is never trained again, by `meshrun train`
or by a worker started again, and a rollback or a resume beyond the end is refused. Every refused
start must leave every file of the run byte for byte as it was.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, TINY, child_env, meshrun, meshrun_each, metrics_records, train_tiny

from meshrun.rundir.lock import LOCK_FILE
from meshrun.testing.processes import descendants, kill_tree

ENV = {"OMP_NUM_THREADS": "1"}
ARGS = ["--nproc-per-node", "1", "--set", "train.steps=12", "--set", "checkpoint.interval=4",
        "--set", "train.eval_interval=6", "--set", "metrics.interval=4"]


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run but the lock file (whose holder line changes) and the launcher logs."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE and "logs" not in p.relative_to(run_dir).parts}


def _one_line_exit_2(result, *expected: str) -> None:
    assert result.returncode == 2, result.output[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr[-3000:]
    assert all(e in lines[0] for e in expected), lines[0]


def _signal_all(pid: int, signum: int) -> None:
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The run, with a second start of its name tried (and refused) while it trains."""
    tmp = tmp_path_factory.mktemp("history")
    run_dir = tmp / "a"
    argv = [str(BIN / "meshrun"), "train", TINY, "--set", "train.name=a", "--set", f"train.run_dir={tmp}", *ARGS]
    first = subprocess.Popen(argv, cwd=tmp, env=child_env(ENV), text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file():  # it holds the lock and trains
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.02)
        _signal_all(first.pid, signal.SIGSTOP)  # frozen, so that its files can be compared byte for byte
        try:
            before = _snapshot(run_dir)
            second, _ = train_tiny(tmp, "a", *ARGS, "--force", timeout=90, env=ENV)  # --force does not help
            _one_line_exit_2(second, f"{run_dir} is in use by another meshrun train (pid {first.pid} on "
                                     f"{socket.gethostname()} since ")
            assert _snapshot(run_dir) == before
        finally:
            _signal_all(first.pid, signal.SIGCONT)
        out, _ = first.communicate(timeout=150)
    except BaseException:
        kill_tree(first.pid)
        raise
    assert first.returncode == 0, out[-3000:]
    assert [r["step"] for r in metrics_records(run_dir, "eval")] == [0, 6, 12]
    assert (run_dir / "finished.json").is_file() and (run_dir / LOCK_FILE).read_text() == ""  # released
    return run_dir


def test_a_finished_run_is_never_trained_again(finished):
    before = _snapshot(finished)
    # A worker started again after the end (an agent restart): it exits 0 at once, training nothing.
    launch = meshrun("launch", "--nproc-per-node", "1", "-m", "meshrun.train.worker", "--run-dir", str(finished),
                     timeout=90, cwd=finished.parent, env=ENV)
    assert launch.returncode == 0 and "has finished (step 12); not training it again" in launch.output, \
        launch.output[-3000:]
    # The lock of a run that died (a file naming it, no flock held) is taken over with a note.
    (finished / LOCK_FILE).write_text('{"pid": 999999999, "host": "gone", "since": 0}\n')
    again, _ = train_tiny(finished.parent, "a", *ARGS, timeout=90, env=ENV)
    assert again.returncode == 0, again.output[-3000:]
    assert "taking over the lock of" in again.stderr and "pid 999999999 on gone" in again.stderr, again.stderr
    assert f"{finished} finished at step 12" in again.stderr and "--force" in again.stderr, again.stderr
    assert _snapshot(finished) == before


def test_rollback_and_resume_beyond_the_end_need_force(finished):
    before = _snapshot(finished)
    ckpts = finished / "checkpoints"
    # both refused before launch: one process checks both, one after the other (torch imported once)
    argv = ["train", TINY, "--set", "train.name=a", "--set", f"train.run_dir={finished.parent}", *ARGS]
    rollback, beyond = meshrun_each([*argv, "--resume", str(ckpts / "step-00000004")],
                                    [*argv, "--set", "train.steps=10"], timeout=90, cwd=finished.parent, env=ENV)
    _one_line_exit_2(rollback, f"rolls {finished} back to step 4", "step-00000012, step-00000008 would be set "
                     "aside", "add --force")
    _one_line_exit_2(beyond, "step-00000012 is beyond train.steps=10", "roll back to step-00000008",
                     "add --force")
    assert _snapshot(finished) == before  # config.toml, metrics.jsonl, checkpoints, model.pt
