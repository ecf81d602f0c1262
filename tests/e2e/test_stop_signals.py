"""SIGINT and SIGTERM at random moments of `meshrun train` (start-up, mid-step, mid-save) end it in seconds.

Each round starts a long tiny run that saves every 3 steps, waits a seeded random delay (from
before the first step to well into training), and sends SIGINT to the whole process group (a
terminal's Ctrl-C) or SIGTERM to the launcher (a scheduler). The command must return within
STOP_BOUND_S, with one line and no traceback, leave no process of the job behind, and exit 0
when a checkpoint was committed (the line says so), else 128 + the signal (130 / 143).
MESHRUN_STOP_ROUNDS sets the number of rounds (CI: 4; `pytest -s` prints the figures).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import time

import pytest
from conftest import BIN, TINY, child_env, env_int

from meshrun.testing.processes import group_members, kill_tree

ROUNDS = env_int("MESHRUN_STOP_ROUNDS", 4)
# torch's agent gives stopped workers 30 s before SIGKILL; meshrun's own stop takes 0.4-2.5 s here.
STOP_BOUND_S = 15


def _one_round(tmp_path, i: int, delay: float, sig: signal.Signals) -> tuple[float, int, str]:
    proc = subprocess.Popen([str(BIN / "meshrun"), "train", TINY, "--set", f"train.name=r{i}",
                             "--set", f"train.run_dir={tmp_path}", "--set", "train.steps=100000",
                             "--set", "train.eval_interval=0", "--set", "checkpoint.interval=3"],
                            cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        time.sleep(delay)
        sent = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the whole foreground group
        else:
            os.kill(proc.pid, sig)
        try:
            _, err = proc.communicate(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"round {i}: {sig.name} after {delay:.2f} s: no exit within {STOP_BOUND_S} s")
        took = time.monotonic() - sent
        gone_by = time.monotonic() + 5  # multiprocessing's resource tracker exits once its pipe closes
        while group_members(proc.pid) and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert not group_members(proc.pid), f"round {i}: processes outlived the job: {group_members(proc.pid)}"
        return took, proc.returncode, err
    finally:
        kill_tree(proc.pid)
        if proc.poll() is None:
            proc.communicate()


@pytest.mark.timeout(60 + 40 * ROUNDS)
def test_signals_at_random_moments_end_the_run_in_seconds(tmp_path):
    rng = random.Random(2412)
    figures = []
    for i in range(ROUNDS):
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        delay = rng.uniform(0.3, 7.0)  # start-up takes ~2-4 s here: some rounds land before the first step
        took, code, err = _one_round(tmp_path, i, delay, sig)
        where = f"round {i}: {sig.name} after {delay:.2f} s"
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, f"{where}\n{err}"
        committed = "checkpoint committed" in err
        assert code == (0 if committed else 128 + sig), f"{where}: exit {code}\n{err}"
        ours = [line for line in err.splitlines() if line.startswith("meshrun")]
        assert ours, f"{where}: no line says what happened\n{err}"
        figures.append((took, delay, sig.name, code))
    times = [f[0] for f in figures]
    print(f"\n{ROUNDS} signals: signal -> exit median {statistics.median(times):.2f} s, max {max(times):.2f} s; "
          + ", ".join(f"{name}@{delay:.1f}s->{took:.2f}s (exit {code})" for took, delay, name, code in figures))
