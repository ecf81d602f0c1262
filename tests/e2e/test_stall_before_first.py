"""The hang watchdog sees a stall before the job's first collective.

Rank 1 sleeps in user code while rank 0 waits in the first all_reduce: no rank has made progress,
yet the report must come within the hang timeout plus a few seconds, name rank 1 as the rank not
in the collective and show its sleeping frame. A rank stuck before it imports torch has no
watchdog of its own; its stack is asked for by signal (faulthandler, set up by the bootstrap).
"""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import child_env, meshrun

from meshrun.launch.spec import WORKER_MAIN

HANG_S = 5
STALL = """\
import os, sys, time
import torch
import torch.distributed as dist


def load_data():
    open(sys.argv[1], "w").write(str(time.time()))
    time.sleep(120)  # SLEEPING-LINE


dist.init_process_group("gloo")
if dist.get_rank() == 1:
    load_data()
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
"""
SLEEP_LINE = STALL.splitlines().index("    time.sleep(120)  # SLEEPING-LINE") + 1


def test_a_rank_stuck_before_the_first_collective_is_reported_by_name(tmp_path):
    script, mark = tmp_path / "stall.py", tmp_path / "stalled-at"
    script.write_text(STALL)
    result = meshrun("launch", "--nproc-per-node", "2", "--hang-timeout", str(HANG_S), "--log-dir",
                     str(tmp_path / "logs"), str(script), str(mark), timeout=120, env={"OMP_NUM_THREADS": "1"})
    ended = time.time()
    out = result.output
    assert result.returncode != 0 and mark.exists(), out
    # the watchdog's timeout, a poll, the peers' answers: seconds, not torch's 2 x timeout or more
    assert ended - float(mark.read_text()) < HANG_S + 10, out
    site = f"{script}:{SLEEP_LINE} in load_data"
    assert f"[rank 0] meshrun: not in a collective: rank 1 (stalled in user code at {site})" in out, out
    assert "Rank 1 failed first" in out and f"rank 1 is stalled in user code at {site}" in out, out
    summary = out.split("Rank 1 failed first")[1]
    assert f'File "{script}", line {SLEEP_LINE} in load_data' in summary, out  # its stack, in the summary
    assert "rank 0 is waiting in all_reduce #1" in out, out


def test_a_rank_without_torch_yet_gives_its_stack_on_signal(tmp_path):
    # Two siblings, as the agent starts workers: a stalled bootstrap (watchdog on, so faulthandler
    # listens) and a peer that asks for its stack the way the alarm rank does.
    stalled = tmp_path / "before_torch.py"
    stalled.write_text("import time\n\n\ndef before_import():\n    time.sleep(60)\n\n\nbefore_import()\n")
    env = child_env({"RANK": "1", "MESHRUN_HANG_TIMEOUT": "5", "TORCHELASTIC_RUN_ID": "t"})
    proc = subprocess.Popen([sys.executable, "-u", WORKER_MAIN, str(stalled)], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # the bootstrap has registered its handler long before this
        asker = subprocess.run(
            [sys.executable, "-c", "from meshrun.debug.stacks import signal_local_ranks as s; print(s([1]))"],
            env=child_env(), capture_output=True, text=True, timeout=60)
        assert asker.stdout.strip() == "[1]", asker.stderr
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert f'File "{stalled}", line 5 in before_import' in err, err
