"""torchft mode end to end: SIGKILL one replica group's worker; the survivor never restarts and
keeps committing steps, the killed group comes back, heals from the survivor and then holds the
survivor's weights, the metrics and the summary show the heal, and every sample is accounted for.

Real processes: `meshrun train` with 2 replica groups x 1 process on the tiny model. The run is
long (train.steps is a bound, not the goal); once the healed group has committed steps together
with the survivor, the test sends SIGTERM to `meshrun train`, which stops both groups (each saves
a checkpoint) and writes the summary.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, TINY, child_env, metrics_records

from meshrun.fault import ledger
from meshrun.testing.processes import kill_tree

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="needs the torchft extra: pip install 'meshrun[torchft]' (make setup installs it)")

DEADLINE_S = 150  # the whole run, killed by pid past this; ~25 s on a quiet machine


def _wait(what: str, check, proc: subprocess.Popen, deadline: float, log: Path):
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"meshrun train exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)
    kill_tree(proc.pid)
    pytest.fail(f"no {what} within {DEADLINE_S}s:\n{log.read_text()[-4000:]}{_group_logs(log.parent)}")


def _group_logs(tmp_path: Path) -> str:
    """Group 1's `meshrun launch` output and its workers' logs: what the launcher's log never shows."""
    found = sorted((tmp_path / "ft" / "torchft").glob("launch-g*.out"))
    found += sorted(p for p in (tmp_path / "ft" / "logs").rglob("*") if p.is_file() and p.stat().st_size)
    events = ledger.read_events(tmp_path / "ft" / "torchft")[-40:]  # starts, heals (which group's), ends
    return "".join(f"\n--- {p.relative_to(tmp_path)}:\n{p.read_text(errors='replace')[-3000:]}" for p in found) + \
        "\n--- torchft events (the last 40):\n" + "\n".join(json.dumps(e) for e in events)


def _rows(records: Path, group: int) -> list[dict]:
    return [r for r in ledger.read_ledgers(records) if r["group"] == group] if records.exists() else []


def _joint(records: Path, group: int) -> list[dict]:
    """`group`'s steps committed in a quorum of both groups. The kill waits for these, not for any steps:
    the group that starts first forms a quorum alone (the lighthouse waits only for groups it has heard
    from) and steps from 0; killed then, before the other has a step, its replacement is as far as the
    other (step 0: no heal at all) or ahead of it (the other heals from it), and no heal of it comes."""
    return [r for r in _rows(records, group) if r["participants"] == 2]


def _heals(records: Path, since: float) -> list[dict]:
    """Heals after `since` (a group that starts late heals once at the start too: not this test's)."""
    return [e for e in ledger.read_events(records) if e["event"] == "heal" and e["time"] > since]


def _last_heal(records: Path, since: float, row: dict) -> dict:
    """The heal of `row`'s process just before `row` (its first row after the heal): a loaded machine
    can add one more after a kill (a heartbeat that lapses: docs/fault-tolerance.md), which the
    ledger's exactness checks still cover."""
    return max((h for h in _heals(records, since) if h["pid"] == row["pid"] and h["time"] < row["time"]),
               key=lambda h: h["time"])


def _starts(records: Path, group: int) -> list[dict]:
    return [e for e in ledger.read_events(records) if e["event"] == "start" and e["group"] == group]


def test_killed_group_heals_from_survivor_without_stopping_it(tmp_path):
    run_dir, records, log = tmp_path / "ft", tmp_path / "ft" / "torchft", tmp_path / "train.log"
    cmd = [str(BIN / "meshrun"), "train", TINY, "--set", "train.name=ft", "--set", f"train.run_dir={tmp_path}",
           "--set", "fault.mode=torchft", "--set", "fault.heartbeat_timeout_ms=1000", "--set", "train.steps=5000",
           "--set", "metrics.interval=1", "--set", "train.eval_interval=0", "--set", "checkpoint.interval=0",
           "--set", "optim.warmup_steps=0", "--max-restarts", "1"]
    with open(log, "wb") as out:  # workers forked from their group's preloaded server
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + DEADLINE_S
    agent = None
    try:
        _wait("3 steps of group 1 with group 0", lambda: len(_joint(records, 1)) >= 3, proc, deadline, log)
        [first] = _starts(records, 1)
        # Group 1's agent is held (SIGSTOP) from the kill until the survivor has committed a step alone: a
        # forked replacement can be back before the survivor's next quorum, and there would be nothing to
        # see (exec'd workers gave those seconds by importing torch again: ~11 s, 400+ steps alone, here).
        agent = _agent(first["pid"])
        os.kill(agent, signal.SIGSTOP)
        os.kill(first["pid"], signal.SIGKILL)
        killed_at = time.time()
        _wait("a step the survivor commits alone",
              lambda: [r for r in _rows(records, 0) if r["time"] > killed_at and r["participants"] == 1],
              proc, deadline, log)
        os.kill(agent, signal.SIGCONT)
        agent = None
        _wait("the heal of group 1", lambda: _heals(records, killed_at), proc, deadline, log)
        # The replacement's rows after its heal (under load a stalled survivor's heartbeat can lapse and
        # let the replacement form a quorum alone and step from 0 first: its heal discards those rows).
        healed = lambda: [r for r in _rows(records, 1) if r["pid"] != first["pid"]  # noqa: E731
                          and any(h["pid"] == r["pid"] and h["time"] < r["time"] for h in _heals(records, killed_at))]
        _wait("3 steps of the healed group 1", lambda: len(healed()) >= 3, proc, deadline, log)
        proc.send_signal(signal.SIGTERM)  # stop the job: both groups save and exit, the summary is written
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if agent is not None:
            with contextlib.suppress(ProcessLookupError):  # gone with the tree if a _wait failed
                os.kill(agent, signal.SIGCONT)
        kill_tree(proc.pid)
    assert code == 128 + signal.SIGTERM, log.read_text()[-4000:]

    # The survivor: one process from start to end, committing steps alone while group 1 was away.
    [survivor] = _starts(records, 0)
    rows0 = _rows(records, 0)
    assert {r["pid"] for r in rows0} == {survivor["pid"]}
    alone = [r for r in rows0 if r["time"] > killed_at and r["participants"] == 1]
    assert alone, "the survivor committed no step while group 1 was healing"
    # The killed group: restarted once, healed from the survivor's step, then in step with it.
    starts1 = _starts(records, 1)
    assert len(starts1) == 2 and starts1[1]["pid"] != first["pid"]
    after = healed()
    heal = _last_heal(records, killed_at, after[0])
    assert heal["group"] == 1 and heal["to_step"] >= alone[0]["step"]
    assert after[0]["step"] == heal["to_step"] + 1 and after[0]["participants"] == 2
    joint = {r["step"]: r for r in rows0 if r["participants"] == 2}
    assert after[0]["step"] in joint, "the survivor did not commit the healed group's first step with it"
    assert after[0]["weights_sum"] == joint[after[0]["step"]]["weights_sum"], "the healed weights differ from the peer's"

    after_kill = [r["time"] for r in rows0 if r["time"] > killed_at]
    stall = max(b - a for a, b in zip([killed_at, *after_kill], after_kill, strict=False))
    print(f"\ntorchft heal: SIGKILL -> heal {heal['time'] - killed_at:.2f} s (the heal itself {heal['seconds']:.2f} s), "
          f"-> first joint commit {after[0]['time'] - killed_at:.2f} s; the survivor's longest pause {stall:.2f} s, "
          f"{len(alone)} steps committed alone")

    # The summary and the metrics say so; the data ledger shows every sample consumed once.
    summary = json.loads((records / "summary.json").read_text())
    assert summary["exact"] and not summary["gaps"] and not summary["overlaps"], summary["lines"]
    assert summary["weights_compared"] >= 1 and not summary["weights_differ"], summary["lines"]
    groups = {g["group"]: g for g in summary["groups"]}
    assert groups[0]["starts"] == 1 and groups[1]["starts"] == 2 and groups[1]["heals"]
    assert groups[0]["steps_with_fewer_groups"] >= len(alone)
    assert "group 1: exit 143, 1 restart(s)" in log.read_text()
    quorums = [r for r in metrics_records(run_dir / "replica-1") if r.get("event") == "torchft_quorum"]
    assert any(r["healed"] and r["quorum_size"] == 2 and r["time"] > killed_at for r in quorums), quorums
    sizes = [r["quorum_size"] for r in metrics_records(run_dir)
             if r.get("event") == "torchft_quorum" and r["time"] > killed_at]
    # The survivor's quorum shrank to itself, then grew back. A quorum of 2 may come first: one the
    # lighthouse formed before the dead group's heartbeat lapsed (its step then fails and is retried).
    assert 1 in sizes and 2 in sizes[sizes.index(1):], sizes


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _agent(worker: int) -> int:
    """The worker's group agent (its `meshrun launch`): the parent of an exec'd worker; for one forked
    from the preloaded server (named meshrun-worker, launch/preload.py), that server's parent."""
    forked = Path(f"/proc/{worker}/comm").read_text().strip() == "meshrun-worker"
    return _parent(_parent(worker)) if forked else _parent(worker)


def test_a_group_back_after_the_others_finished_stops_instead_of_training_alone(tmp_path):
    """Group 1's worker is killed and its agent held (SIGSTOP) until group 0 has finished the run;
    the replacement then finds nobody to heal from. It must stop (exit 0, no final weights of its
    own), not train the run again from its own step as a second lineage whose weights differ."""
    run_dir, records, log = tmp_path / "ft", tmp_path / "ft" / "torchft", tmp_path / "train.log"
    steps = 40
    # The first quorum waits for both groups (join timeout): group 1 starts with group 0, not after its end.
    cmd = [str(BIN / "meshrun"), "train", TINY, "--set", "train.name=ft", "--set", f"train.run_dir={tmp_path}",
           "--set", "fault.mode=torchft", "--set", "fault.heartbeat_timeout_ms=1000", "--set", f"train.steps={steps}",
           "--set", "fault.join_timeout_ms=60000",
           "--set", "train.eval_interval=0", "--set", "checkpoint.interval=0", "--set", "optim.warmup_steps=0",
           "--max-restarts", "1"]
    with open(log, "wb") as out:  # workers forked from their group's preloaded server, the agent's child
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + DEADLINE_S
    agent = None
    group0_done = lambda: any(e["event"] == "done" and e["group"] == 0 for e in ledger.read_events(records))  # noqa: E731
    try:
        # On a loaded machine group 1 may start only after group 0 has finished alone: the same case
        # (back after the others finished), met at its first start; else kill it and hold its agent.
        _wait("2 steps of group 1 or group 0's end", lambda: len(_rows(records, 1)) >= 2 or group0_done(),
              proc, deadline, log)
        killed = not group0_done()
        if killed:
            [first] = _starts(records, 1)
            agent = _agent(first["pid"])
            os.kill(agent, signal.SIGSTOP)
            os.kill(first["pid"], signal.SIGKILL)
            _wait("group 0's end", group0_done, proc, deadline, log)
            os.kill(agent, signal.SIGCONT)
            agent = None
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if agent is not None:
            os.kill(agent, signal.SIGCONT)
        kill_tree(proc.pid)
    text = log.read_text()
    assert code == 0, text[-4000:] + _group_logs(tmp_path)
    starts1 = _starts(records, 1)
    assert len(starts1) == (2 if killed else 1), starts1  # the agent did restart the killed worker
    ended = [e for e in ledger.read_events(records) if e["event"] == "ended"]
    assert [(e["group"], e["pid"], e["finished_by"]) for e in ended] == [(1, starts1[-1]["pid"], [0])], ended
    assert not [r for r in _rows(records, 1) if r["pid"] == starts1[-1]["pid"]], "group 1 trained the run again alone"
    summary = json.loads((records / "summary.json").read_text())
    assert not summary["weights_differ"] and summary["final_weights_group"] == 0, summary["lines"]
    assert "group(s) [0] had finished the run" in summary["lines"][1], summary["lines"]
    assert (run_dir / "model.pt").exists() and not (run_dir / "replica-1" / "finished.json").exists()
