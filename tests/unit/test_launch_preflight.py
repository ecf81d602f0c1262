"""Rendezvous preflight (real sockets and a real TCPStore) and the plain-python explanation.

How fast each verdict comes is measured in benchmarks/launch_preflight.py, not asserted here:
these tests check what is decided; pytest's per-test timeout bounds a hang.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from meshrun.errors import LaunchError
from meshrun.launch import preflight
from meshrun.launch.preflight import check_rendezvous, is_local_host, parse_endpoint
from meshrun.launch.store_probe import c10d_handshake
from meshrun.runtime import plain_python


def launch_args(endpoint: str, *, rdzv_id: str = "mine", nnodes: str = "1", backend: str = "c10d",
                master_addr: str = "127.0.0.1") -> argparse.Namespace:
    return argparse.Namespace(rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_id=rdzv_id,
                              master_addr=master_addr, master_port=None, nnodes=nnodes, node_rank=0,
                              standalone=False)


def refusal(args: argparse.Namespace) -> str:
    with pytest.raises(LaunchError) as info:
        check_rendezvous(args)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- endpoint syntax ------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", [":29400", " :29400", "[]:29400"])
def test_empty_host_names_master_addr(endpoint):
    message = refusal(launch_args(endpoint, nnodes="2"))
    assert "has no host" in message and "$MASTER_ADDR" in message and "node 0's address" in message


@pytest.mark.parametrize(("endpoint", "words"), [
    ("node0:", ["has no port", "$MASTER_PORT", "node0:29400"]),
    ("node0:abc", ["'abc' is not a TCP port"]),
    ("node0:70000", ["'70000' is not a TCP port"]),
    ("no de:29400", ["'no de' is not a host name"]),
])
def test_malformed_endpoint_says_what_and_how(endpoint, words):
    message = refusal(launch_args(endpoint, nnodes="2"))
    assert message.startswith(f"--rdzv-endpoint {endpoint!r}")
    for word in words:
        assert word in message


@pytest.mark.parametrize(("endpoint", "expected"), [
    ("", ("localhost", 29400)),  # torch's default
    ("node0", ("node0", 29400)),  # a bare host gets torch's default port, as under torchrun
    ("10.0.0.1:1234", ("10.0.0.1", 1234)),
    ("[::1]:1234", ("::1", 1234)),
    ("localhost:0", ("localhost", 0)),
])
def test_parse_endpoint_reads_like_torch(endpoint, expected):
    assert parse_endpoint(endpoint) == expected


def test_empty_master_addr_with_static_backend():
    args = launch_args("", backend="static", master_addr="", nnodes="2")
    message = refusal(args)
    assert "--master-addr is empty" in message and "$MASTER_ADDR" in message


def test_local_hosts():
    assert is_local_host("localhost") and is_local_host("127.0.0.1") and is_local_host("127.0.0.2")
    assert is_local_host(socket.gethostname())
    assert not is_local_host("192.0.2.1")  # TEST-NET-1: never assigned


# --- a port held by something that is not a store --------------------------------------------------

HOLDER = """\
import socket, sys, threading, time
mode = sys.argv[1]
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(8)
print(sock.getsockname()[1], flush=True)
conns = []
def serve(conn):
    if mode == "http":
        conn.recv(64)
        conn.sendall(b"HTTP/1.0 400 Bad Request\\r\\n\\r\\n")
    if mode == "echo":  # sends the handshake back: must not pass for a store
        conn.sendall(conn.recv(64))
    if mode in ("close", "http"):
        conn.close()
    else:
        conns.append(conn)  # 'silent' and 'echo' keep the connection open and say nothing
sock.settimeout(1)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        threading.Thread(target=serve, args=(sock.accept()[0],), daemon=True).start()
    except OSError:
        pass
"""


class Holder:
    """A plain-python process (no torch) listening on a port: 'silent' accepts and never answers,
    'close' hangs up, 'http' answers like a web server, 'echo' sends back what it got."""

    def __init__(self, mode: str):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, mode], stdout=subprocess.PIPE,
                                     text=True)
        self.port = int(self.proc.stdout.readline())

    def close(self):
        self.proc.kill()
        self.proc.communicate()


@pytest.mark.parametrize("mode", ["silent", "close", "http", "echo"])
def test_foreign_program_on_the_port_is_named_within_seconds(mode):
    holder = Holder(mode)
    try:
        message = refusal(launch_args(f"127.0.0.1:{holder.port}"))
    finally:
        holder.close()
    # No thread is left inside torch's client: one would abort the interpreter at exit.
    assert not [t for t in threading.enumerate() if t.name.startswith("meshrun-store")]
    assert f"port {holder.port} is held by pid {holder.proc.pid} (" in message, message
    assert "not a torch c10d store" in message and "choose another port" in message


def test_bound_but_not_listening_port():
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
        message = refusal(launch_args(f"localhost:{port}"))
    assert f"port {port} is bound on this host but accepts no connections" in message


def test_free_port_and_port_zero_pass_without_a_probe(monkeypatch):
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(preflight, "probe_store", lambda *a, **k: pytest.fail("a free port needs no probe"))
    assert check_rendezvous(launch_args(f"127.0.0.1:{port}", nnodes="2")) == preflight.WILL_HOST
    assert check_rendezvous(launch_args("localhost:0")) == preflight.AGENT_BINDS
    assert check_rendezvous(argparse.Namespace(standalone=True)) == preflight.STANDALONE


def test_remote_endpoint_with_nobody_listening_passes(monkeypatch):
    # Node 0 not up yet (or unreachable): the agent waits for it; the preflight must not.
    monkeypatch.setattr(preflight, "probe_store", lambda *a, **k: pytest.fail("nobody listens: no probe"))
    assert check_rendezvous(launch_args("192.0.2.1:29400", nnodes="2")) == preflight.NOT_UP_YET


def test_busy_master_port_is_refused_naming_the_holder():
    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        args = launch_args("", backend="static", nnodes="2")
        args.master_port = port
        message = refusal(args)
    assert message.startswith(f"--master-port: port {port} is already in use by pid {os.getpid()}")
    assert f"--master-port {port + 1}" in message


# --- a live c10d store: whose rendezvous is it? ------------------------------------------------------

@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    yield master
    del master


@pytest.mark.parametrize("use_libuv", [True, False])
def test_handshake_recognizes_both_store_backends(use_libuv):
    # The handshake is torch's wire protocol spoken by hand: this fails first if torch changes it.
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=use_libuv)
    assert all(c10d_handshake("127.0.0.1", master.port) for _ in range(20))
    del master


def test_store_of_another_run_id_is_refused(store):
    store.set("torch.rendezvous.jobA", "state")
    store.set("torch.rendezvous.jobA.0/MASTER_PORT", "1")
    message = refusal(launch_args(f"127.0.0.1:{store.port}", rdzv_id="jobB", nnodes="2"))
    assert f"--rdzv-endpoint 127.0.0.1:{store.port} is already used by another job (rdzv-id jobA" in message
    assert "choose another port, or --rdzv-id jobA to join it" in message


def test_second_node_of_the_same_job_joins(store):
    store.set("torch.rendezvous.jobA", "state")
    assert check_rendezvous(launch_args(f"127.0.0.1:{store.port}", rdzv_id="jobA", nnodes="2")) == preflight.JOINS
    assert check_rendezvous(launch_args(f"127.0.0.1:{store.port}", rdzv_id="jobA", nnodes="1:4")) == preflight.JOINS


def test_single_node_job_with_the_same_id_is_refused(store):
    # e.g. two single-node jobs with `--rdzv-backend c10d` and no endpoint: both localhost:29400, id "none"
    store.set("torch.rendezvous.none", "state")
    message = refusal(launch_args(f"localhost:{store.port}", rdzv_id="none"))
    assert "already used by another job (the same --rdzv-id none" in message
    assert "leave --rdzv-endpoint out" in message


def test_store_without_rendezvous_keys_is_another_job(store):
    store.set("/default_pg/0//key", "x")  # e.g. a static-backend job's MASTER_PORT store
    message = refusal(launch_args(f"127.0.0.1:{store.port}", nnodes="2"))
    assert "already used by another job (a store with no c10d rendezvous in it" in message


def test_empty_store_waits_for_node_0_to_write_its_key(store):
    # Node 0's agent binds the port a moment before it writes its rendezvous key.
    # Had it not waited, it would have seen an empty store (EMPTY_STORE), not this job's (JOINS).
    threading.Timer(0.5, store.set, args=("torch.rendezvous.jobA", "state")).start()
    assert check_rendezvous(launch_args(f"127.0.0.1:{store.port}", rdzv_id="jobA", nnodes="2")) == preflight.JOINS


def test_empty_store_passes_after_the_grace(store):
    assert check_rendezvous(launch_args(f"127.0.0.1:{store.port}", nnodes="2")) == preflight.EMPTY_STORE


# --- plain python ------------------------------------------------------------------------------------

def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


def test_explains_missing_env_key_with_the_command(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    exc = _raised(lambda: int(os.environ["LOCAL_RANK"]))
    line = plain_python.explain_missing_launcher_env(exc, argv=["train.py", "--lr", "3e-4"])
    assert line.startswith("meshrun: LOCAL_RANK is not set")
    from meshrun.runtime.device import auto_nproc_per_node

    n = auto_nproc_per_node()  # what `--nproc-per-node auto` picks
    assert line.endswith(f"run: meshrun launch --nproc-per-node {n} train.py --lr 3e-4")


def test_explains_torch_env_rendezvous_error(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    exc = _raised(lambda: dist.init_process_group("gloo"))
    assert isinstance(exc, ValueError)
    line = plain_python.explain_missing_launcher_env(exc, argv=["t.py"])
    assert line and "RANK is not set" in line and "meshrun launch --nproc-per-node" in line


@pytest.mark.parametrize("exc", [KeyError("lr"), KeyError("RANK", "x"), ValueError("RANK"), OSError()])
def test_other_errors_are_left_alone(exc):
    assert plain_python.explain_missing_launcher_env(exc) is None


def test_launch_command_quotes_arguments():
    cmd = plain_python.launch_command(["my train.py", "--name", "a b"], nproc=2)
    assert cmd == "meshrun launch --nproc-per-node 2 'my train.py' --name 'a b'"


def test_remote_endpoint_answering_as_something_else_only_warns(monkeypatch, caplog):
    # A remote host cannot be told apart from a proxy that accepts every connection: warn, go on.
    holder = Holder("silent")
    monkeypatch.setattr(preflight, "is_local_host", lambda host: False)
    try:
        verdict = check_rendezvous(launch_args(f"127.0.0.1:{holder.port}", nnodes="2"))
    finally:
        holder.close()
    assert verdict == preflight.NOT_A_STORE_REMOTE
    assert "answers, but not as a torch c10d store" in caplog.text

