"""The rendezvous traps of torch 2.13 (docs/errors.md) and plain `python` on a torchrun script,
end to end: real agents, real holders of the port, real workers.

How fast a trap is refused is measured by benchmarks/launch_preflight.py; here each run is only
bounded (a trap that is not caught hangs: the bound fails the test)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import pytest
from conftest import BIN, free_port, meshrun, run_proc

from meshrun.testing.processes import kill_tree

SILENT_HOLDER = """\
import socket, sys, time
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(8)
print(sock.getsockname()[1], flush=True)
conns = []
deadline = time.monotonic() + 120
while time.monotonic() < deadline:  # accept and never answer, like a stuck server
    sock.settimeout(1)
    try:
        conns.append(sock.accept()[0])
    except OSError:
        pass
"""

SLEEPER = """\
import os, sys, time
open(sys.argv[1], "w").write(os.environ["RANK"])
time.sleep(120)
"""

ALL_REDUCE = """\
import torch, torch.distributed as dist
import meshrun

env = meshrun.init()
x = torch.tensor([env.rank + 1.0])
dist.all_reduce(x)
print(f"world_size={env.world_size} sum={x.item():.0f}", flush=True)
"""

NOOP = "print('never runs')\n"


def _launch_args(endpoint: str, rdzv_id: str, *, nnodes: int = 1) -> list[str]:
    return ["launch", "--nnodes", str(nnodes), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]


def _popen(cmd: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)


def _wait_listening(port: int, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"nothing listened on port {port} within {timeout}s")


def _one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.output
    return lines[0]


def _diagnosed_as(log_dir, kind: str) -> None:
    """`meshrun diagnose` on the refused launch's --log-dir: the launcher failed first, and why."""
    result = meshrun("diagnose", str(log_dir), "--json", timeout=60)
    report = json.loads(result.stdout)
    assert result.returncode == 1 and report["classification"] == kind, result.output
    assert report["first_failure"]["rank"] == -1 and report["attempts"] == 0, report


def test_rdzv_port_held_by_a_silent_program_is_refused_not_hung(tmp_path, write_script):
    script = write_script("noop.py", NOOP)
    holder = _popen([sys.executable, "-c", SILENT_HOLDER])
    try:
        port = int(holder.stdout.readline())
        result = meshrun(*_launch_args(f"127.0.0.1:{port}", "job1"), "--log-dir", str(tmp_path / "logs"),
                         str(script), timeout=120)
    finally:
        kill_tree(holder.pid)
        holder.communicate()
    line = _one_line(result)
    assert f"port {port} is held by pid {holder.pid}" in line and "not a torch c10d store" in line
    assert "choose another port" in line
    _diagnosed_as(tmp_path / "logs", "port conflict")


def test_second_job_on_a_running_jobs_endpoint_is_refused(tmp_path, write_script):
    sleeper = write_script("sleeper.py", SLEEPER)
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    job_a = _popen([str(BIN / "meshrun"), *_launch_args(endpoint, "jobA"), str(sleeper), str(tmp_path / "a")])
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "a").exists():
            assert job_a.poll() is None and time.monotonic() < deadline, job_a.communicate()
            time.sleep(0.2)
        other_id = meshrun(*_launch_args(endpoint, "jobB"), "--log-dir", str(tmp_path / "logs"), str(sleeper),
                           str(tmp_path / "b"), timeout=120)
        same_id = meshrun(*_launch_args(endpoint, "jobA"), str(sleeper), str(tmp_path / "c"), timeout=120)
        assert job_a.poll() is None  # job A is untouched
    finally:
        kill_tree(job_a.pid)
        job_a.communicate()
    line = _one_line(other_id)
    assert f"--rdzv-endpoint {endpoint} is already used by another job (rdzv-id jobA" in line
    assert "--rdzv-id jobA to join it" in line
    assert "the same --rdzv-id jobA" in _one_line(same_id)  # one node: no second node to be
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    _diagnosed_as(tmp_path / "logs", "port conflict")


def test_two_nodes_of_one_job_on_loopback_still_meet(write_script):
    script = write_script("all_reduce.py", ALL_REDUCE)
    port = free_port()
    args = [*_launch_args(f"127.0.0.1:{port}", "pair", nnodes=2), str(script)]
    node0 = _popen([str(BIN / "meshrun"), *args])
    try:
        _wait_listening(port, 120, node0)  # node 1's preflight then meets node 0's live store
        node1 = meshrun(*args, timeout=180)
        out0, err0 = node0.communicate(timeout=120)
    finally:
        kill_tree(node0.pid)
    assert node1.returncode == 0, node1.output
    assert node0.returncode == 0, out0 + err0
    for out in (out0, node1.stdout):
        assert re.search(r"^\[rank \d\] world_size=2 sum=3$", out, re.M), out


def test_empty_master_addr_in_the_guides_multi_node_command_names_it(write_script):
    script = write_script("noop.py", NOOP)
    command = (f"{BIN / 'meshrun'} launch --nnodes=2 --nproc-per-node=1 --rdzv-id=100 "
               f"--rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29400 {script}")
    result = run_proc(["bash", "-c", command], env={"MASTER_ADDR": ""}, timeout=120)
    line = _one_line(result)
    assert "--rdzv-endpoint ':29400' has no host: is $MASTER_ADDR empty?" in line


@pytest.mark.parametrize(("body", "var"), [
    ('local_rank = int(os.environ["LOCAL_RANK"])\n', "LOCAL_RANK"),
    ('world = int(os.environ["WORLD_SIZE"])\n', "WORLD_SIZE"),
])
def test_plain_python_on_a_torchrun_script_ends_with_the_launch_command(write_script, body, var):
    # The hint comes from meshrun.init() (its excepthook), never from `import meshrun` alone.
    script = write_script("train.py", f"import os\nimport meshrun\nmeshrun.init()\n{body}print('trained')\n")
    result = run_proc([sys.executable, str(script), "--lr", "3e-4"], timeout=120)
    assert result.returncode != 0 and "trained" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"meshrun: {var} is not set"), result.stderr
    assert re.search(rf"run: meshrun launch --nproc-per-node \d+ {re.escape(str(script))} --lr 3e-4$", last)
