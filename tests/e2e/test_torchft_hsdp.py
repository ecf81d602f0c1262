"""torchft mode with HSDP replica groups end to end: 2 groups x 2 processes, FSDP2 inside each group.
SIGKILL group 1's second worker (not the writer of its ledger); group 0 never restarts, group 1
restarts, heals from group 0 (each rank from the peer's same local rank: local shards), and after
the heal both groups hold equal weights (the ledger's fingerprints, summed over each group's
shards, agree); every sample is consumed exactly once. Modelled on test_torchft_heal.py (its helpers).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, TINY, child_env
from test_torchft_heal import _heals, _joint, _last_heal, _rows, _starts, _wait

from meshrun.testing.processes import kill_tree

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="needs the torchft extra: pip install 'meshrun[torchft]' (make setup installs it)")

DEADLINE_S = 240  # the whole run, killed by pid past this (150 s ran out once beside another CPU-heavy job)


def _sibling(pid: int) -> int:
    """The other worker of `pid`'s group: the process with the same parent (its group's forkserver, or its
    agent where workers are exec'd: MESHRUN_PRELOAD=0)."""
    def ppid(p: int) -> int:
        return int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])

    parent = ppid(pid)
    others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != pid and _alive_child(int(p), parent, ppid)]
    assert len(others) == 1, f"group 1's agent {parent} has workers {others} besides {pid}"
    return others[0]


def _alive_child(p: int, parent: int, ppid) -> bool:
    try:
        return ppid(p) == parent
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def test_hsdp_group_heals_from_survivor(tmp_path):
    records, log = tmp_path / "ft" / "torchft", tmp_path / "train.log"
    cmd = [str(BIN / "meshrun"), "train", TINY, "--set", "train.name=ft", "--set", f"train.run_dir={tmp_path}",
           "--set", "fault.mode=torchft", "--set", "fault.group_size=2", "--set", "parallel.strategy=fsdp",
           "--set", "fault.heartbeat_timeout_ms=1000", "--set", "train.steps=5000", "--set", "train.eval_interval=0",
           "--set", "checkpoint.interval=0", "--set", "optim.warmup_steps=0", "--max-restarts", "1"]
    with open(log, "wb") as out:  # workers forked from their group's preloaded server (one `import torch` a group)
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + DEADLINE_S
    try:
        _wait("3 steps of group 1 with group 0", lambda: len(_joint(records, 1)) >= 3, proc, deadline, log)
        [first] = _starts(records, 1)
        victim = _sibling(first["pid"])
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        _wait("the heal of group 1", lambda: _heals(records, killed_at), proc, deadline, log)
        healed = lambda: [r for r in _rows(records, 1) if r["pid"] != first["pid"]  # noqa: E731
                          and any(h["pid"] == r["pid"] and h["time"] < r["time"] for h in _heals(records, killed_at))]
        _wait("2 steps of the healed group 1", lambda: len(healed()) >= 2, proc, deadline, log)
        proc.send_signal(signal.SIGTERM)  # both groups save and exit, the summary is written
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        kill_tree(proc.pid)
    text = log.read_text()
    assert code == 128 + signal.SIGTERM, text[-4000:]

    [survivor] = _starts(records, 0)  # group 0: one writer process from start to end, no restart
    assert {r["pid"] for r in _rows(records, 0)} == {survivor["pid"]}
    starts1 = _starts(records, 1)
    assert len(starts1) == 2 and starts1[1]["pid"] != first["pid"]
    after = healed()
    heal = _last_heal(records, killed_at, after[0])
    assert heal["group"] == 1
    assert after[0]["step"] == heal["to_step"] + 1 and after[0]["participants"] == 2
    joint = {r["step"]: r for r in _rows(records, 0) if r["participants"] == 2}
    assert after[0]["step"] in joint, "the survivor did not commit the healed group's first step with it"
    assert after[0]["weights_sum"] == joint[after[0]["step"]]["weights_sum"], "the healed weights differ from the peer's"

    summary = json.loads((records / "summary.json").read_text())
    assert summary["exact"] and not summary["gaps"] and not summary["overlaps"], summary["lines"]
    assert summary["weights_compared"] >= 1 and not summary["weights_differ"], summary["lines"]
    groups = {g["group"]: g for g in summary["groups"]}
    assert groups[0]["starts"] == 1 and groups[1]["starts"] == 2 and groups[1]["heals"]
    assert "group 1: exit 143, 1 restart(s)" in text
    print(f"\ntorchft HSDP heal: SIGKILL of group 1's local rank 1 -> heal {heal['time'] - killed_at:.2f} s "
          f"(the heal itself {heal['seconds']:.2f} s), -> first joint commit {after[0]['time'] - killed_at:.2f} s")
