"""Checkpoints end to end: SIGKILL, torn write, corruption, SIGTERM and bad --resume, on real processes.

Every interrupted run must end with final weights bitwise equal to an uninterrupted run's, and a
per-sample log (checkpoint.sample_log) showing each sample of the completed steps consumed once.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, TINY, child_env, meshrun, meshrun_each, run_proc

from meshrun.checkpoint.samples import effective_samples
from meshrun.testing.processes import kill_tree, worker_pids

STEPS = 60
COMMON = ["--nproc-per-node", "2", "--set", f"train.steps={STEPS}", "--set", "train.eval_interval=0",
          "--set", "checkpoint.interval=5", "--set", "checkpoint.sample_log=true", "--set", "metrics.jsonl=false"]
ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _args(tmp: Path, name: str, *extra: str) -> list[str]:
    return ["train", TINY, "--set", f"train.name={name}", "--set", f"train.run_dir={tmp}", *COMMON, *extra]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def _assert_same_run(run_dir: Path, ref_dir: Path) -> None:
    """Bitwise-equal final weights, and exactly the reference's samples, each consumed once."""
    ref, got = _weights(ref_dir), _weights(run_dir)
    assert ref.keys() == got.keys()
    unequal = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not unequal, f"weights differ from the uninterrupted run: {unequal[:3]}"
    samples, ref_samples = effective_samples(run_dir), effective_samples(ref_dir)
    assert sorted(samples) == list(range(1, STEPS + 1))
    flat = [s for step in samples.values() for s in step]
    assert len(flat) == len(set(flat)), "a sample was consumed twice"
    assert samples == ref_samples


def _start(tmp: Path, name: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    full = child_env(ENV, env)
    return subprocess.Popen([str(BIN / "meshrun"), *_args(tmp, name, *extra)], cwd=tmp, env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 150) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        pytest.fail(f"did not finish within {timeout}s: {proc.communicate()[0][-3000:]}")
    return proc.returncode, out


def _unnamed(tmp: Path) -> list[str]:
    """The command line with no train.name: each new run gets a timestamped directory under `tmp`."""
    return [str(BIN / "meshrun"), "train", TINY, "--set", f"train.run_dir={tmp}", *COMMON]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, started as an unnamed one: the last test starts the same command again
    beside it (a finished run is never continued: it starts a new one), so one run serves both."""
    tmp = tmp_path_factory.mktemp("ckpt")
    result = run_proc(_unnamed(tmp), timeout=150, cwd=tmp, env=ENV)
    assert result.returncode == 0, result.output
    (run_dir,) = [p for p in tmp.iterdir() if p.is_dir()]
    return run_dir


def _sessions(run_dir: Path) -> list[list[dict]]:
    """Rank 0's sample-log rows grouped by session (one session per start of the workers), in order."""
    rows = [json.loads(line) for line in (run_dir / "samples" / "rank-00000.jsonl").read_text().splitlines()]
    order = sorted({r["session"] for r in rows})
    return [[r for r in rows if r["session"] == s] for s in order]


def _wait_for(proc: subprocess.Popen, run_dir: Path, session: int, step: int, timeout: float = 120) -> None:
    """Until the `session`-th start of the workers (0-based) has completed `step`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            sessions = _sessions(run_dir)
        except (OSError, ValueError):
            sessions = []
        if len(sessions) > session and sessions[session][-1]["step"] >= step:
            return
        time.sleep(0.02)
    kill_tree(proc.pid)
    pytest.fail(f"session {session} never reached step {step}: {proc.communicate()[0][-3000:]}")


def test_torn_write_sigkill_sigterm_and_corruption_all_resume_exactly(reference, tmp_path):
    """One run survives all of it, with async saves on, then a re-run of the same command finishes it."""
    args = ("--max-restarts", "3", "--set", "checkpoint.async_save=true",
            "--set", "checkpoint.snapshot_interval=0")  # resumes from disk: in-memory snapshots are tested apart
    run_dir = tmp_path / "chain"
    proc = _start(tmp_path, "chain", *args, env={"MESHRUN_FAULT": "ckpt_write:10"})
    # 1. Torn write: the last rank dies in the middle of writing step 10; the restart resumes from 5.
    _wait_for(proc, run_dir, session=1, step=6)
    # 2. SIGKILL one worker at a random step; the agent restarts the group again.
    kill_step = random.Random().randint(12, 25)
    _wait_for(proc, run_dir, session=1, step=kill_step)
    workers = worker_pids(proc.pid)
    assert workers, "no worker process found"
    os.kill(random.choice(workers), signal.SIGKILL)
    # 3. SIGTERM to the agent, as a scheduler's preemption: a committed checkpoint, exit 0.
    _wait_for(proc, run_dir, session=2, step=kill_step + 3)
    os.kill(proc.pid, signal.SIGTERM)
    code, out = _finish(proc)
    assert code == 0, out[-4000:]
    assert "ignoring incomplete checkpoint step-00000010.tmp-" in out, out[-4000:]
    resumed = [int(s) for s in re.findall(r"resumed from \S+/step-(\d+) ", out)]
    assert resumed[0] == 5 and 5 <= resumed[1] <= kill_step, (resumed, out[-4000:])
    stopped = re.search(r"stopped by SIGTERM at step (\d+), checkpoint committed; re-run", out)
    assert stopped, out[-4000:]
    stopped_at = int(stopped.group(1))
    assert kill_step < stopped_at < STEPS and not (run_dir / "model.pt").exists()
    assert (run_dir / "checkpoints" / f"step-{stopped_at:08d}").is_dir()

    # 4. Corruption: flip a bit in the newest checkpoint's shard, truncate the one before; both are
    # named by `meshrun ckpt list` and skipped, with a warning, by the re-run of the same command.
    newest, previous = sorted((run_dir / "checkpoints").glob("step-*"))[-1:-3:-1]
    flipped, truncated = newest / "__1_0.distcp", previous / "__0_0.distcp"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    listed = meshrun("ckpt", "list", str(run_dir), timeout=60)
    assert listed.returncode == 0, listed.output
    assert f"{flipped} fails its sha256 check" in listed.stdout and "truncated" in listed.stdout, listed.stdout
    proc = _start(tmp_path, "chain", *args)
    code, out = _finish(proc)
    assert code == 0, out[-4000:]
    assert f"skipping damaged checkpoint {newest.name}: {flipped} fails its sha256 check" in out, out[-4000:]
    assert f"skipping damaged checkpoint {previous.name}: {truncated} is" in out, out[-4000:]
    assert len(_sessions(run_dir)) == 4
    _assert_same_run(run_dir, reference)


def test_bad_resume_path_is_one_line_exit_2(reference, tmp_path):
    not_a_ckpt = tmp_path / "empty"
    not_a_ckpt.mkdir()
    other_shape = reference / "checkpoints" / f"step-{STEPS:08d}"
    cases = [
        (["--resume", str(not_a_ckpt)], "not a meshrun checkpoint directory"),
        (["--resume", str(other_shape), "--set", "model.dim=32"], "does not fit this model"),
    ]  # both refused before launch: one process checks both (torch imported once)
    results = meshrun_each(*[_args(tmp_path, "bad", *args) for args, _ in cases], timeout=90, cwd=tmp_path, env=ENV)
    for (_, expected), result in zip(cases, results, strict=True):
        assert result.returncode == 2, result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], result.stderr
        assert "Traceback" not in result.output


def test_unnamed_run_preempted_then_the_same_command_continues_it(reference):
    """No train.name: the run gets a timestamped directory, and the re-run must find it again.

    `reference` is the same command's finished run: starting the command again starts a new run
    beside it (no "continuing"), which is preempted, and the re-run continues that one, not a third."""
    tmp = reference.parent
    env = child_env(ENV)

    def start() -> subprocess.Popen:
        return subprocess.Popen(_unnamed(tmp), cwd=tmp, env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def new_runs() -> list[Path]:
        return [p for p in tmp.iterdir() if p != reference and (p / "samples").is_dir()]

    proc = start()
    deadline = time.monotonic() + 120
    while not new_runs():
        if proc.poll() is not None or time.monotonic() >= deadline:
            kill_tree(proc.pid)
            pytest.fail(f"no new run directory: {proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    (run_dir,) = new_runs()
    _wait_for(proc, run_dir, session=0, step=8)
    os.kill(proc.pid, signal.SIGTERM)
    code, out = _finish(proc)
    assert code == 0 and "checkpoint committed; re-run the same command" in out, out[-4000:]
    assert "continuing" not in out, out[-4000:]  # the finished run was not continued: a new one started
    code, out = _finish(start())
    assert code == 0, out[-4000:]
    assert f"continuing the unfinished run {run_dir}" in out, out[-4000:]
    assert sorted(p for p in tmp.iterdir() if p.is_dir()) == sorted([reference, run_dir])  # no third run directory
    _assert_same_run(run_dir, reference)
