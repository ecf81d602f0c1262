"""SIGKILL a random worker again and again: every restart resumes from the in-memory snapshot, exactly.

Disk checkpoints every 10 steps, snapshots every step, a kill every few steps (20 in CI;
MESHRUN_SNAPSHOT_KILLS=100 for the benchmark side, docs/fault-tolerance.md): each restart must
load the snapshot (events.jsonl says so), redo fewer steps than the disk checkpoint would make it
redo, and the run must end with weights bitwise equal to an uninterrupted run's and every sample
seen once. Every worker of every attempt was forked from the pre-imported, single-threaded
forkserver (launch/preload.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, TINY, child_env

from meshrun.checkpoint.samples import effective_samples
from meshrun.runtime.events import read as read_events
from meshrun.testing.processes import kill_tree, worker_pids

KILLS = int(os.environ.get("MESHRUN_SNAPSHOT_KILLS", "20"))  # each costs a restart (about 1 s, more under load)
GAP, DISK_EVERY = 6, 10  # steps between kills; disk checkpoints
# Steps after the last kill's window: on a quiet machine a tiny step takes ~15 ms, and without a
# tail the run finished before the test could kill it the last times (CI, 4ed6e8a: a margin of 3
# steps). 150 steps (60 failed beside a 2-process train) are ~2 s on a quiet machine for a poll every 10 ms to see the target step and
# kill, and a loaded machine slows the steps as much as the poll; each tail step costs both runs.
TAIL = 150
STEPS = GAP * KILLS + 4 + TAIL
DEADLINE_S = 45 + 10 * KILLS  # both runs; about 60 s for 20 kills on a quiet machine
COMMON = ["--nproc-per-node", "2", "--set", f"train.steps={STEPS}", "--set", "train.eval_interval=0",
          "--set", f"checkpoint.interval={DISK_EVERY}", "--set", "checkpoint.sample_log=true",
          "--set", "metrics.jsonl=false", "--set", "checkpoint.snapshot_interval=1"]
REF_SAVES_NOTHING = ["--set", "checkpoint.interval=0", "--set", "checkpoint.snapshot_interval=0"]
ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _args(tmp: Path, name: str, *extra: str) -> list[str]:
    return ["train", TINY, "--set", f"train.name={name}", "--set", f"train.run_dir={tmp}", *COMMON, *extra]


def _last_step(run_dir: Path, session_index: int) -> int:
    """The last step rank 0 logged in its `session_index`-th start (-1 before it has one)."""
    try:
        rows = [json.loads(line) for line in (run_dir / "samples" / "rank-00000.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return -1
    sessions = sorted({r["session"] for r in rows})
    if len(sessions) <= session_index:
        return -1
    return max(r["step"] for r in rows if r["session"] == sessions[session_index])


@pytest.mark.timeout(max(300, DEADLINE_S + 30))  # MESHRUN_SNAPSHOT_KILLS=100 runs longer than the default
def test_repeated_sigkills_resume_from_memory_bitwise_and_exactly_once(tmp_path):
    # Output to files, not pipes: 20 kills' tracebacks fill a pipe nobody reads until the end, and
    # a launcher blocked on a full pipe stops restarting.
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("ref", "killed")}  # noqa: SIM115
    # The uninterrupted run saves nothing (no disk checkpoints, no snapshots): the killed run must
    # still end bitwise equal to it, and its 27 disk saves and 274 snapshots cost CPU, not coverage.
    ref = subprocess.Popen([str(BIN / "meshrun"), *_args(tmp_path, "ref", *REF_SAVES_NOTHING)], cwd=tmp_path,
                           env=child_env(ENV),
                           stdout=logs["ref"], stderr=subprocess.STDOUT, start_new_session=True)
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([str(BIN / "meshrun"), *_args(tmp_path, "killed", "--max-restarts", str(KILLS))],
                            cwd=tmp_path, env=child_env(ENV), stdout=logs["killed"], stderr=subprocess.STDOUT,
                            start_new_session=True)

    def output(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()[-4000:]

    rng = random.Random()
    killed_after, killed_at, deadline = [], [], time.monotonic() + DEADLINE_S
    try:
        for kill in range(KILLS):
            # away from the disk checkpoints (10, 20, ...), where memory and disk hold the same step
            target = rng.choice([s for s in range(kill * GAP + 2, kill * GAP + GAP + 2) if s % DISK_EVERY not in (9, 0, 1)])
            while _last_step(run_dir, kill) < target:
                assert proc.poll() is None and time.monotonic() < deadline, output("killed")
                time.sleep(0.01)
            workers = worker_pids(proc.pid)
            assert len(workers) == 2, f"not 2 worker processes: {workers}"
            os.kill(rng.choice(workers), signal.SIGKILL)
            killed_at.append(time.time())
            killed_after.append(_last_step(run_dir, kill))
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        ref.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail("a run did not finish in time")
    finally:
        kill_tree(proc.pid)
        kill_tree(ref.pid)
        for fp in logs.values():
            fp.close()
    out = (tmp_path / "killed.log").read_text()
    assert proc.returncode == 0, out[-4000:]
    assert ref.returncode == 0, output("ref")

    events = read_events(run_dir)
    resumed = [e for e in events if e["event"] == "resumed" and e["rank"] == 0 and e["attempt"] > 0]
    stepped = [e["time"] for e in events if e["event"] == "first_step" and e["rank"] == 0 and e["attempt"] > 0]
    recoveries = sorted(b - a for a, b in zip(killed_at, stepped, strict=False))
    print(f"SIGKILL -> next completed step, {len(recoveries)} kills: median {recoveries[len(recoveries) // 2]:.2f} s, "
          f"max {recoveries[-1]:.2f} s; load average {Path('/proc/loadavg').read_text().split()[:3]}")
    starts = [e for e in events if e["event"] == "worker_start"]
    assert len(starts) == 2 * (KILLS + 1), starts
    assert all(e["forkserver_threads"] == 1 for e in starts), starts  # pre-imported, and forked single-threaded
    assert all(e["forkserver"] == "launcher" for e in starts), starts  # forked from the launcher itself
    # From memory every time, except where memory held nothing newer than the disk checkpoint: a
    # kill during the snapshot right after a disk save (a loaded machine drifts from the target
    # step) leaves both at the same step, and the disk copy is taken (checkpoint/snapshot.py).
    tied = [e for e in resumed if e["source"] == "disk" and e["snapshot_step"] is not None
            and e["snapshot_step"] <= e["step"]]
    assert [e["source"] for e in resumed if e not in tied] == ["snapshot"] * (KILLS - len(tied)), resumed
    assert len(tied) <= KILLS // 10, tied
    for kill, event in enumerate(resumed):  # the rank killed mid-step may not have its snapshot of that step
        assert killed_after[kill] - 1 <= event["step"] <= killed_after[kill] + 1, (killed_after, resumed)
        disk_step = int(event["disk"].split("-")[1]) if event["disk"] else 0
        assert disk_step < event["step"] or event in tied, (killed_after, resumed)  # disk alone would redo more
    assert "resumed from the in-memory snapshot of step" in out

    ref_w = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    got_w = torch.load(run_dir / "model.pt", weights_only=True)
    assert ref_w.keys() == got_w.keys()
    assert not [k for k in ref_w if not torch.equal(ref_w[k], got_w[k])], "weights differ from the uninterrupted run"
    samples = effective_samples(run_dir)
    assert sorted(samples) == list(range(1, STEPS + 1))
    flat = [s for step in samples.values() for s in step]
    assert len(flat) == len(set(flat)) and samples == effective_samples(tmp_path / "ref")
    assert not list(Path(os.environ.get("MESHRUN_SNAPSHOT_ROOT", "/dev/shm")).glob(f"meshrun-{proc.pid}-*"))
