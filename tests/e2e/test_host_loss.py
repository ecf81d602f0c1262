"""Lose a whole "host" of a two-node loopback run: the job resumes from the peer host's in-memory copy.

Two `meshrun train` launchers (node 0 hosts the c10d store, node 1), one worker each, snapshots
every step copied to the other node's launcher area (snapshot_peer.py). Node 1's launcher and
worker are SIGKILLed, as a lost host's processes and memory would be; a replacement node 1
launcher starts with a new, empty area (the dead one's is removed as stale). The restarted job
must load the new host's rank from node 0's copy ("peer" in events.jsonl), not from disk, and end
with weights bitwise equal to an uninterrupted run's. The new rendezvous orders launchers by pid, so
after a pid wrap-around the new host is rank 0 and node 0 runs rank 1 from its peer copy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, TINY, child_env, free_port

from meshrun.checkpoint.snapshot_slots import peek_slot
from meshrun.runtime.events import read as read_events
from meshrun.testing.processes import kill_tree

# STEPS leaves ~2 s of steps after KILL_AFTER even on a quiet machine (a tiny step is ~15-25 ms):
# the test must kill node 1 before the run ends.
STEPS, KILL_AFTER = 120, 6
COMMON = ["--set", f"train.steps={STEPS}", "--set", "train.eval_interval=0", "--set", "checkpoint.interval=100",
          "--set", "checkpoint.sample_log=true", "--set", "metrics.jsonl=false",
          "--set", "checkpoint.snapshot_interval=1"]
ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _launch(tmp: Path, name: str, *extra: str, log: str) -> subprocess.Popen:
    cmd = [str(BIN / "meshrun"), "train", TINY, "--set", f"train.name={name}", "--set", f"train.run_dir={tmp}",
           *COMMON, *extra]
    return subprocess.Popen(cmd, cwd=tmp, env=child_env(ENV), stdout=(tmp / log).open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _peer_step_of_rank1(launcher_pid: int) -> int:
    """The newest step of rank 1 that node 0's launcher area holds whole (-1 if none yet).

    A slot counts only while its `.ok` mark exists both before and after it is read: the mark is
    removed before a slot is overwritten, so a slot read under its mark is the one the resume sees.
    """
    root = Path(os.environ.get("MESHRUN_SNAPSHOT_ROOT", "/dev/shm"))
    held = -1
    for ok in root.glob(f"meshrun-{launcher_pid}-*/peer-rank1/slot-*.snap.ok"):
        peeked = peek_slot(ok.with_suffix(""))
        if peeked is not None and ok.exists():
            held = max(held, peeked[0])
    return held


@pytest.mark.timeout(240)
def test_lost_host_resumes_from_the_peer_hosts_memory_bitwise(tmp_path):
    t0 = time.monotonic()
    port = free_port()
    nodes = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", "hostloss", "--max-restarts", "2"]
    ref = _launch(tmp_path, "ref", "--nproc-per-node", "2", log="ref.log")  # same world size and layout
    procs = [_launch(tmp_path, "lost", *nodes, log="node0.log")]
    run_dir = tmp_path / "lost"
    deadline = time.monotonic() + 180
    try:
        while True:  # node 0 hosts the store: node 1 is the one to go
            assert procs[0].poll() is None and time.monotonic() < deadline, (tmp_path / "node0.log").read_text()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.2)
        procs.append(_launch(tmp_path, "lost", *nodes, log="node1.log"))
        while (held := _peer_step_of_rank1(procs[0].pid)) < KILL_AFTER:
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                (tmp_path / "node0.log").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(procs[1].pid, signal.SIGKILL)  # the host's processes: launcher and worker, by pid
        kill_tree(procs[1].pid)
        killed_at = time.time()
        procs[1].wait(timeout=10)
        procs.append(_launch(tmp_path, "lost", *nodes, log="node1b.log"))  # the replacement host
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in (procs[0], procs[2], ref)]
    except subprocess.TimeoutExpired:
        pytest.fail("a run did not finish in time:\n" + (tmp_path / "node0.log").read_text()[-3000:])
    finally:
        for p in [*procs, ref]:
            kill_tree(p.pid)
    logs = {name: (tmp_path / name).read_text() for name in ("node0.log", "node1b.log", "ref.log")}
    assert codes == [0, 0, 0], {k: v[-3000:] for k, v in logs.items()}

    resumed = {e["rank"]: e for e in read_events(run_dir) if e["event"] == "resumed" and e["time"] > killed_at}
    assert resumed.keys() == {0, 1}, resumed
    # the new rendezvous orders the launchers by pid, so the replacement host may be rank 0 or 1:
    # its rank loads from node 0's copy ("peer"), node 0's rank from its own area ("snapshot"), never disk
    assert sorted(e["source"] for e in resumed.values()) == ["peer", "snapshot"], resumed
    # node 0 held rank 1's step `held` whole when node 1 was killed: nothing older may be resumed
    assert all(e["step"] >= held >= KILL_AFTER and e["disk"] is None for e in resumed.values()), (held, resumed)
    on_new_host = next(e for e in resumed.values() if e["source"] == "peer")
    stepped = min(e["time"] for e in read_events(run_dir) if e["event"] == "first_step" and e["time"] > killed_at)
    print(f"host loss: SIGKILL -> next completed step {stepped - killed_at:.1f}s, resumed at step "
          f"{on_new_host['step']} from node 0's copy (rank {on_new_host['rank']} on the new host); "
          f"test {time.monotonic() - t0:.1f}s")

    ref_w = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    got_w = torch.load(run_dir / "model.pt", weights_only=True)
    assert ref_w.keys() == got_w.keys()
    assert not [k for k in ref_w if not torch.equal(ref_w[k], got_w[k])], "weights differ from the uninterrupted run"
