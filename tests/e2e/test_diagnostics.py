"""Failures explained in seconds, end to end through `meshrun launch` and `meshrun diagnose`:
a rank stalled in user code (hang watchdog), one extra all_reduce (--debug collectives), DDP
device_ids on CPU (an exception with its fix), a rank killed by a signal, a rank that segfaults, and
duplicated data."""

from __future__ import annotations

import json
import time

import pytest
from conftest import meshrun

SCENARIOS = """\
import os, signal, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import meshrun

MARK = sys.argv[2]

def wait_for_ever():
    while True:
        time.sleep(0.5)

env = meshrun.init()
mode = sys.argv[1]
x = torch.ones(4)
for step in range(4):
    dist.all_reduce(x)
    if env.rank == 1 and step == 1:
        open(MARK, "w").write(str(time.time()))
        if mode == "stall":
            wait_for_ever()
        if mode == "extra":
            dist.all_reduce(x)  # EXTRA-CALL
        if mode == "ddp":
            nn.parallel.DistributedDataParallel(nn.Linear(2, 2), device_ids=[0])
    if env.rank == 0 and step == 1 and mode == "kill":
        open(MARK, "w").write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if env.rank == 0 and step == 1 and mode == "segv":
        open(MARK, "w").write(str(time.time()))
        import ctypes
        ctypes.string_at(0)  # reads address 0: a segfault in native code
if mode == "data":
    meshrun.check_dataloader(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
print("finished", flush=True)
"""
EXTRA_LINE = SCENARIOS.splitlines().index("            dist.all_reduce(x)  # EXTRA-CALL") + 1
# How fast the report comes after the fault is measured by benchmarks/diagnostics.py (fault to
# report); here a run is only bounded, so that a report that never comes fails the test.
OMP = {"OMP_NUM_THREADS": "1"}


def _launch(tmp_path, mode: str, *flags: str):
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIOS)
    logs, mark = tmp_path / f"logs-{mode}", tmp_path / f"fault-{mode}"
    result = meshrun("launch", "--nproc-per-node", "2", "--log-dir", str(logs), *flags, str(script), mode,
                     str(mark), timeout=150, env=OMP)
    ended = time.time()
    since_fault = ended - float(mark.read_text()) if mark.exists() else None
    return result, logs, since_fault


def _diagnose(logs) -> tuple[str, dict]:
    text = meshrun("diagnose", str(logs), timeout=60)
    data = meshrun("diagnose", str(logs), "--json", timeout=60)
    return text.stdout, json.loads(data.stdout)


def test_stalled_rank_hang_watchdog_dumps_every_stack(tmp_path):
    result, logs, since_fault = _launch(tmp_path, "stall", "--hang-timeout", "10")
    out = result.output
    assert result.returncode != 0, out
    assert since_fault is not None, out  # the stall happened, and the job ended (bounded by _launch)
    for rank in (0, 1):  # every rank's stack, with the stalled function named
        assert f"[rank {rank}] meshrun: rank {rank}'s Python stacks, every thread:" in out, out
    assert "in wait_for_ever" in out and "in <module>" in out
    assert "Rank 1 failed first" in out and "rank 1 is stalled in user code at" in out, out
    assert "wait_for_ever" in out.split("Rank 1 failed first")[1].splitlines()[1]
    assert "rank 0 is waiting in all_reduce" in out  # the consequence, below
    text, data = _diagnose(logs)
    assert "classification: hang" in text and "first failure: rank 1" in text, text
    assert data["classification"] == "hang" and data["first_failure"]["rank"] == 1
    assert len(data["timeline"]) == 2


def test_extra_all_reduce_is_named_with_rank_and_line(tmp_path):
    result, logs, since_fault = _launch(tmp_path, "extra", "--debug", "collectives")
    out = result.output
    assert result.returncode != 0, out
    assert since_fault is not None, out
    assert "Rank 1 failed first" in out, out
    assert "rank 1 diverged first: its #3 all_reduce(float32[4]) at " in out, out
    assert f"scenario.py:{EXTRA_LINE} in <module> is from a line rank 0 never calls a collective from" in out
    text, data = _diagnose(logs)
    assert "classification: collective mismatch" in text and "first failure: rank 1" in text, text
    assert data["first_failure"]["rank"] == 1


@pytest.mark.parametrize("mode,rank,kind,detail", [
    ("ddp", 1, "exception in user code", "on CPU leave them out, DDP(model)"),
    ("kill", 0, "killed by signal", "killed by SIGKILL"),
    ("segv", 0, "native crash", "killed by SIGSEGV"),
])
def test_first_failure_leads_and_diagnose_classifies(tmp_path, mode, rank, kind, detail):
    result, logs, _ = _launch(tmp_path, mode)
    out = result.output
    assert result.returncode != 0, out
    assert f"Rank {rank} failed first" in out, out
    assert detail in out.split(f"Rank {rank} failed first")[1], out
    text, data = _diagnose(logs)
    assert f"classification: {kind}" in text and f"first failure: rank {rank}" in text, text
    assert detail in text, text
    assert data["classification"] == kind and data["first_failure"]["rank"] == rank


def test_duplicated_data_is_a_warning_diagnose_finds(tmp_path):
    result, logs, _ = _launch(tmp_path, "data")
    assert result.returncode == 0, result.output
    assert "meshrun: data warning: all 2 ranks read the identical first batch" in result.output
    text, data = _diagnose(logs)
    assert "classification: data duplication warning" in text, text
    assert data["classification"] == "data duplication warning"


def test_inconsistent_timeouts_are_refused_in_one_line(tmp_path):
    script = tmp_path / "never_started.py"
    script.write_text("raise SystemExit('a refused launch must not start workers')\n")
    result = meshrun("launch", "--nproc-per-node", "2", "--rdzv-conf", "join_timeout=60", str(script), timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.output
    assert "join_timeout=60 is below the init timeout 600s" in lines[0]
