"""A single-node job listens on loopback only: the agent's store, rank 0's store and gloo.

Listening sockets are read from /proc while the job runs: the socket inodes among each of the
job's processes' fds, matched against /proc/net/tcp and tcp6 in state LISTEN.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, TINY, child_env, free_port

from meshrun.runtime.store import hold_server
from meshrun.testing.processes import descendants, kill_tree

_LISTEN = "0A"


def _address(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    # /proc/net/tcp* print each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port_hex, 16)


def listeners(root: int) -> set[tuple[int, str, int]]:
    """{(pid, address, port)} of the LISTEN sockets held by `root` and its descendants."""
    owner: dict[str, int] = {}
    for pid in [root, *descendants(root)]:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fp:
            next(fp)
            for line in fp:
                fields = line.split()
                if fields[3] == _LISTEN and fields[9] in owner:
                    found.add((owner[fields[9]], *_address(fields[1])))
    return found


def _not_loopback(found: set[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    return sorted(f for f in found if not ipaddress.ip_address(f[1]).is_loopback)


def test_listeners_helper_sees_every_interface_and_loopback():
    """The reader tells `::`/0.0.0.0 from 127.0.0.1 (else the job tests below could not fail)."""
    import socket

    with socket.socket() as wide, hold_server("127.0.0.1", 0, one_node=True) as store:
        wide.bind(("0.0.0.0", 0))
        wide.listen()
        found = listeners(os.getpid())
        assert (os.getpid(), "0.0.0.0", wide.getsockname()[1]) in found
        assert (os.getpid(), "127.0.0.1", store.port) in found
    with hold_server("192.0.2.1", 0, one_node=False) as elsewhere:
        assert elsewhere is None  # not this machine's address: torch binds as it would


HOLD = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # the guide's way, not meshrun.init(): rank 0's env:// store
t = torch.ones(1)
dist.all_reduce(t)
open(os.path.join(sys.argv[1], f"ready{dist.get_rank()}"), "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(sys.argv[1], "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    env = child_env()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # meshrun picks them when unset
        env.pop(var, None)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_launch_of_a_plain_script_listens_on_loopback_only(tmp_path, backend):
    """`meshrun launch` of a script calling init_process_group itself: the agent's store, rank 0's
    env:// store (c10d: a port of its own; static: the agent's) and gloo, all on 127.0.0.1."""
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    rdzv = ["--master-port", str(free_port())] if backend == "static" else []
    proc = _start([str(BIN / "meshrun"), "launch", "--nproc-per-node", "2", *rdzv, str(script), str(tmp_path)],
                  tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the job did not reach its first collective"
            time.sleep(0.05)
        found = listeners(proc.pid)
        (tmp_path / "go").touch()
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, out
    # the agent's store, each rank's gloo listener and (c10d) rank 0's own store
    assert len({pid for pid, _, _ in found}) >= 3, found
    assert len([f for f in found if f[0] != proc.pid]) >= (3 if backend == "c10d" else 2), found
    assert any(pid == proc.pid for pid, _, _ in found), f"no agent store seen: {found}"
    assert not _not_loopback(found), f"listening beyond loopback: {_not_loopback(found)}"


def test_train_single_node_listens_on_loopback_only(tmp_path):
    """`meshrun train` tiny on 2 processes, sampled while it runs: no listener beyond loopback."""
    proc = _start([str(BIN / "meshrun"), "train", TINY, "--set", "train.name=lo", "--set",
                   f"train.run_dir={tmp_path}", "--set", "train.steps=4", "--set", "metrics.jsonl=false",
                   "--set", "checkpoint.interval=0"], tmp_path)
    seen: set[tuple[int, str, int]] = set()
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= listeners(proc.pid)
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, out
    assert len({pid for pid, _, _ in seen}) >= 3, seen  # the agent and both ranks were seen listening
    assert not _not_loopback(seen), f"listening beyond loopback: {_not_loopback(seen)}"
