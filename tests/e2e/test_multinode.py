"""Several nodes on one machine: two `meshrun launch` agents joined by c10d rendezvous.

On loopback; across two network namespaces joined by a veth pair (as root), where torchrun by
hand fails (docs/multinode.md); and elastic membership:
a node killed mid-run leaves the other to continue alone, or end with one clear line when the
minimum of nodes can no longer be met.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, EXAMPLES, free_port

from meshrun.testing.processes import describe_tree, kill_tree

ALL_REDUCE = """\
import os, time
import torch, torch.distributed as dist
import meshrun

env = meshrun.init()
x = torch.tensor([env.rank + 1.0])
dist.all_reduce(x)
print(f"rank={env.rank} world={env.world_size} sum={x.item():.0f} t={time.time():.3f} "
      f"ifname={os.environ.get('GLOO_SOCKET_IFNAME')} master={os.environ['MASTER_ADDR']}", flush=True)
"""

# Steps an all_reduce counter; each node's local rank 0 keeps the node's own state on disk, so a
# restarted group resumes where its node left off. Global rank 0 marks when 4 ranks reached step 3.
ELASTIC = """\
import os, sys, time
import torch, torch.distributed as dist
import meshrun

env = meshrun.init()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
state_dir = sys.argv[1]
path = os.path.join(state_dir, "state.pt")
state = torch.load(path) if os.path.exists(path) else {"step": 0}
print(f"start attempt={attempt} world={env.world_size} step={state['step']}", flush=True)
while state["step"] < 12:
    x = torch.ones(1)
    dist.all_reduce(x)
    state = {"step": state["step"] + 1}
    if env.local_rank == 0:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    print(f"step {state['step']} world={env.world_size} sum={x.item():.0f} t={time.time():.3f}", flush=True)
    if env.rank == 0 and env.world_size == 4 and state["step"] == 3:
        open(os.path.join(state_dir, "..", "ready"), "w").close()
    # slow steps on 4 ranks: the test kills a node after "ready", however loaded the machine is
    time.sleep(2.0 if env.world_size == 4 and state["step"] >= 3 else 0.3)
print("done", flush=True)
"""

NODE_TIMEOUT_S = 120


def _agent(args: list[str], *, log: Path, cwd: Path, netns: str | None = None,
           command: str = "launch") -> subprocess.Popen:
    cmd = [str(BIN / "meshrun"), command, *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait(proc: subprocess.Popen, timeout: float, log: Path) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = describe_tree(proc.pid)  # the workers' stacks go to the log: read it after
        kill_tree(proc.pid)
        pytest.fail(f"agent did not finish within {timeout}s:\n{log.read_text()[-6000:]}\n{tree}")


def _wait_for(path_or_port, timeout: float, procs: list[subprocess.Popen]) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"an agent exited early with {proc.returncode}"
        if callable(path_or_port):
            if path_or_port():
                return
        elif isinstance(path_or_port, Path):
            if path_or_port.exists():
                return
        else:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", path_or_port), timeout=1):
                return
        time.sleep(0.2)
    pytest.fail(f"{path_or_port} not ready within {timeout}s")


def _two_node_args(endpoint: str, rdzv_id: str, nnodes: str = "2") -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]


def _check_all_reduce(logs: list[str], t0: float, ifnames: list[str], master: str) -> float:
    rows = []
    for node, text in enumerate(logs):
        for m in re.finditer(r"rank=(\d) world=(\d) sum=(\d+) t=([\d.]+) ifname=(\S+) master=(\S+)", text):
            rows.append((int(m[1]), int(m[2]), int(m[3]), float(m[4]), m[5], m[6], node))
    assert sorted(r[0] for r in rows) == [0, 1, 2, 3], logs
    for rank, world, total, _, ifname, addr, node in rows:
        assert (world, total) == (4, 10), logs  # 1 + 2 + 3 + 4 over both nodes
        assert ifname == ifnames[node] and addr == master, (rank, ifname, addr)
    return max(r[3] for r in rows) - t0


@pytest.mark.timeout(2 * NODE_TIMEOUT_S)
def test_two_nodes_on_loopback_all_reduce(tmp_path, write_script):
    script = write_script("all_reduce.py", ALL_REDUCE)
    args = _two_node_args(f"127.0.0.1:{free_port()}", "loopback2x2") + [str(script)]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    t0 = time.time()
    procs = [_agent(args, log=log, cwd=tmp_path) for log in logs]
    try:
        codes = [_wait(p, NODE_TIMEOUT_S, log) for p, log in zip(procs, logs, strict=True)]
    finally:
        for p in procs:
            kill_tree(p.pid)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts
    elapsed = _check_all_reduce(texts, t0, ["lo", "lo"], "127.0.0.1")
    print(f"loopback 2x2: launch to first all_reduce {elapsed:.1f}s")


def _netns_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "the `ip` tool (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


@contextlib.contextmanager
def _two_hosts():
    """Namespaces A and B joined by a veth pair, 10.77.N.1 and .2; removed on the way out."""
    tag = f"mr{os.getpid() % 100000}"
    subnet = f"10.77.{os.getpid() % 250}"
    names = [f"{tag}a", f"{tag}b"]
    steps = [["ip", "netns", "add", names[0]], ["ip", "netns", "add", names[1]],
             ["ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"]]
    for ns, dev, addr in zip(names, (f"{tag}va", f"{tag}vb"), (f"{subnet}.1/24", f"{subnet}.2/24"), strict=True):
        steps += [["ip", "link", "set", dev, "netns", ns], ["ip", "-n", ns, "addr", "add", addr, "dev", dev],
                  ["ip", "-n", ns, "link", "set", "lo", "up"], ["ip", "-n", ns, "link", "set", dev, "up"]]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, timeout=10)
        yield names, [f"{tag}va", f"{tag}vb"], f"{subnet}.1"
    finally:
        for ns in names:  # deleting a namespace deletes the veth end in it, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", f"{tag}va"], capture_output=True, timeout=10)


@pytest.mark.timeout(2 * NODE_TIMEOUT_S)
def test_two_nodes_in_network_namespaces_find_host_role_and_interface(tmp_path, write_script):
    reason = _netns_reason()
    if reason:
        pytest.skip(reason)
    script = write_script("all_reduce.py", ALL_REDUCE)
    with _two_hosts() as (namespaces, devices, host_addr):
        # Plain torchrun fails here: no agent hosts the store (the endpoint is not the host name's
        # address), and gloo binds 127.0.0.1. meshrun sets is_host, --local-addr and the interface.
        args = _two_node_args(f"{host_addr}:{free_port()}", "netns2x2") + [str(script)]
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        t0 = time.time()
        procs = [_agent(args, log=log, cwd=tmp_path, netns=ns) for log, ns in zip(logs, namespaces, strict=True)]
        try:
            codes = [_wait(p, NODE_TIMEOUT_S, log) for p, log in zip(procs, logs, strict=True)]
        finally:
            for p in procs:
                kill_tree(p.pid)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts
    elapsed = _check_all_reduce(texts, t0, devices, host_addr)
    print(f"netns 2x2: launch to first all_reduce {elapsed:.1f}s")


def _elastic_pair(tmp_path: Path, script: Path, nnodes: str, extra: list[str]):
    """Start node A (it hosts the store), then node B; return both once 4 ranks reached step 3."""
    port = free_port()
    args = _two_node_args(f"127.0.0.1:{port}", f"elastic-{nnodes.replace(':', '-')}", nnodes) + [
        "--max-restarts", "2", *extra]
    procs, logs = [], []
    for node in ("a", "b"):
        (tmp_path / node).mkdir()
        logs.append(tmp_path / f"{node}.log")
        procs.append(_agent([*args, str(script), str(tmp_path / node)], log=logs[-1], cwd=tmp_path))
        if node == "a":
            _wait_for(port, 60, procs)  # A's agent holds the rendezvous store: B must be the one to go
    _wait_for(tmp_path / "ready", NODE_TIMEOUT_S, procs)
    return procs, logs


# Fast dead-node detection (torch: 5 s x 3 heartbeats) and a short last call (torch: 30 s).
FAST_RDZV = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"
# Enough steps that node A, training alone until node B's agent has started and joined, is still
# training then on a loaded machine: with 150, A finished alone in 25 s at load 7 while B's
# `meshrun train` had printed nothing yet (CI, 'an agent exited early with 0', twice).
ELASTIC_STEPS = 400


@pytest.mark.timeout(3 * NODE_TIMEOUT_S)
def test_elastic_node_killed_the_other_continues_alone_from_its_state(tmp_path, write_script):
    script = write_script("elastic.py", ELASTIC)
    procs, logs = _elastic_pair(tmp_path, script, "1:2", ["--rdzv-conf", FAST_RDZV])
    try:
        killed_at = time.time()
        os.killpg(procs[1].pid, signal.SIGKILL)  # node B's agent and its session, by pid
        kill_tree(procs[1].pid)
        code = _wait(procs[0], NODE_TIMEOUT_S, logs[0])
    finally:
        for p in procs:
            kill_tree(p.pid)
    text = logs[0].read_text()
    assert code == 0, text
    saved = int(re.search(r"\[rank 0\] start attempt=1 world=2 step=(\d+)", text)[1])
    assert saved >= 3, text  # node A resumed alone from its own saved step, not from 0
    after = [(int(s), int(w), float(t)) for s, w, t in
             re.findall(r"\[rank 0\] step (\d+) world=(\d) sum=\d+ t=([\d.]+)", text) if float(t) > killed_at]
    assert [s for s, _, _ in after] == list(range(saved + 1, 13)) and {w for _, w, _ in after} == {2}, text
    assert re.search(r"meshrun: attempt 0 failed on \S+: .*restarting \(restart 1 of --max-restarts 2\)", text)
    print(f"scale-down: node kill to the survivor's first resumed step {after[0][2] - killed_at:.1f}s")


@pytest.mark.timeout(3 * NODE_TIMEOUT_S)
def test_elastic_minimum_not_met_ends_with_one_line(tmp_path, write_script):
    script = write_script("elastic.py", ELASTIC)
    extra = ["--hang-timeout", "0", "--rdzv-conf", f"{FAST_RDZV},join_timeout=15"]
    procs, logs = _elastic_pair(tmp_path, script, "2", extra)
    try:
        os.killpg(procs[1].pid, signal.SIGKILL)
        kill_tree(procs[1].pid)
        code = _wait(procs[0], NODE_TIMEOUT_S, logs[0])  # bounded: a node that waits for ever fails here
    finally:
        for p in procs:
            kill_tree(p.pid)
    text = logs[0].read_text()
    assert code == 1, text
    lines = [line for line in text.splitlines() if "meshrun: rendezvous" in line]
    assert len(lines) == 1 and "timed out" in lines[0] and "join_timeout=15s" in lines[0], text
    assert "--nnodes 1:2" in lines[0] and "Traceback" not in text.split("restarting")[-1], text


@pytest.mark.timeout(4 * NODE_TIMEOUT_S)  # the port, B's checkpoint, then A's finish (60 + 120 + 240 s at most)
def test_meshrun_train_node_killed_the_other_resumes_from_the_checkpoint_alone(tmp_path):
    port = free_port()
    args = [str(EXAMPLES / "configs" / "tiny.toml"), "--set", "train.name=elastic", "--set", f"train.run_dir={tmp_path}",
            "--set", "model.dim=32", "--set", "model.n_layers=2", "--set", f"train.steps={ELASTIC_STEPS}",
            "--set", "train.eval_interval=0", "--set", "checkpoint.interval=5",
            *_two_node_args(f"127.0.0.1:{port}", "train-elastic", "1:2"), "--max-restarts", "2",
            "--rdzv-conf", FAST_RDZV]
    args[args.index("--nproc-per-node") + 1] = "1"  # 2 nodes x 1 process: dp 2, then dp 1
    run_dir = tmp_path / "elastic"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [_agent(args, log=logs[0], cwd=tmp_path, command="train")]
    try:
        _wait_for(port, 60, procs)  # node A hosts the rendezvous store, so node B is the one to go
        procs.append(_agent(args, log=logs[1], cwd=tmp_path, command="train"))
        # Node B may join after node A's first rendezvous closed (a loaded machine): A then trains
        # alone until the agents re-rendezvous with B. Kill B only once a checkpoint of both exists.
        _wait_for(lambda: _latest_world_size(run_dir) == 2, NODE_TIMEOUT_S, procs)
        os.killpg(procs[1].pid, signal.SIGKILL)
        kill_tree(procs[1].pid)
        code = _wait(procs[0], 2 * NODE_TIMEOUT_S, logs[0])
    finally:
        for p in procs:
            kill_tree(p.pid)
    text = logs[0].read_text()
    assert code == 0, text
    assert re.search(r"meshrun: resumed from \S+step-\d+ \(step \d+, saved on 2 processes", text), text
    assert f"step {ELASTIC_STEPS}/{ELASTIC_STEPS}" in text, text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metas = [row["world_size"] for row in rows if row.get("kind") == "meta" and "world_size" in row]
    assert 2 in metas and metas[-1] == 1, metas  # trained on both nodes, finished on the survivor


def _latest_world_size(run_dir: Path) -> int | None:
    try:
        name = (run_dir / "checkpoints" / "latest").read_text().strip()
        manifest = json.loads((run_dir / "checkpoints" / name / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("layout", {}).get("world_size")


SLURM_SCRIPT = """\
import os
import torch, torch.distributed as dist
import meshrun

env = meshrun.init()
x = torch.tensor([1.0])
dist.all_reduce(x)
print(f"run_id={os.environ['TORCHELASTIC_RUN_ID']} world={env.world_size} sum={x.item():.0f}", flush=True)
"""


def test_faked_one_node_slurm_job_derives_the_rendezvous(tmp_path, write_script):
    import socket

    from conftest import meshrun

    script = write_script("slurm_job.py", SLURM_SCRIPT)
    port = free_port()
    env = {"SLURM_JOB_ID": "777", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "OMP_NUM_THREADS": "1",
           "SLURM_JOB_NODELIST": socket.gethostname(), "MESHRUN_RDZV_PORT": str(port)}
    result = meshrun("launch", "--nproc-per-node", "2", str(script), env=env, cwd=tmp_path, timeout=NODE_TIMEOUT_S)
    assert result.returncode == 0, result.output
    assert result.stdout.count("run_id=777 world=2 sum=2") == 2, result.output
