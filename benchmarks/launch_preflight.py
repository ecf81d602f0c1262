"""Launch preflight: seconds from `check_rendezvous` to its verdict, for each rendezvous trap.

    python benchmarks/launch_preflight.py --repeats 3

The unit tests (tests/unit/test_launch_preflight.py) check what each case decides; this measures
how fast, against the bounds meshrun promises:
- a c10d port held by a program that is not a store (silent, hangs up, answers HTTP, echoes):
  refused within 10 s (torchrun hangs for ever);
- a port bound but not listening: refused at once (< 2 s);
- a free port, port 0, standalone: passed without a probe (< 1 s);
- a remote endpoint nobody answers at (node 0 not up yet): passed within the connect timeout (< 5 s);
- another job's store: refused within 10 s; an empty store: passed after the grace
  (EMPTY_STORE_GRACE_S, not before).
Each case runs in this process against real sockets and a real TCPStore; holders are killed by pid.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time

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
    if mode == "echo":
        conn.sendall(conn.recv(64))
    if mode in ("close", "http"):
        conn.close()
    else:
        conns.append(conn)
sock.settimeout(1)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        threading.Thread(target=serve, args=(sock.accept()[0],), daemon=True).start()
    except OSError:
        pass
"""


def _options(endpoint: str, *, rdzv_id: str = "mine", nnodes: str = "1") -> argparse.Namespace:
    return argparse.Namespace(rdzv_backend="c10d", rdzv_endpoint=endpoint, rdzv_id=rdzv_id, master_addr="127.0.0.1",
                              master_port=None, nnodes=nnodes, node_rank=0, standalone=False)


def _timed(options: argparse.Namespace) -> tuple[float, str]:
    from meshrun.errors import LaunchError
    from meshrun.launch.preflight import check_rendezvous

    start = time.monotonic()
    try:
        verdict = check_rendezvous(options)
    except LaunchError:
        verdict = "refused"
    return time.monotonic() - start, verdict


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def foreign_holder(mode: str) -> tuple[float, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, mode], stdout=subprocess.PIPE, text=True)
    try:
        return _timed(_options(f"127.0.0.1:{int(proc.stdout.readline())}"))
    finally:
        proc.kill()
        proc.communicate()


def bound_not_listening() -> tuple[float, str]:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return _timed(_options(f"localhost:{sock.getsockname()[1]}"))


def free_port_and_zero() -> tuple[float, str]:
    first = _timed(_options(f"127.0.0.1:{_free_port()}", nnodes="2"))
    second = _timed(_options("localhost:0"))
    return first[0] + second[0], f"{first[1]} / {second[1]}"


def remote_nobody() -> tuple[float, str]:
    return _timed(_options("192.0.2.1:29400", nnodes="2"))  # TEST-NET-1: never assigned


def store_case(key: str | None, rdzv_id: str) -> tuple[float, str]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    try:
        if key:
            store.set(key, "state")
        return _timed(_options(f"127.0.0.1:{store.port}", rdzv_id=rdzv_id, nnodes="2"))
    finally:
        del store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from meshrun.launch.store_probe import EMPTY_STORE_GRACE_S

    cases = {
        "foreign holder, silent (<= 10 s)": lambda: foreign_holder("silent"),
        "foreign holder, hangs up (<= 10 s)": lambda: foreign_holder("close"),
        "foreign holder, http (<= 10 s)": lambda: foreign_holder("http"),
        "foreign holder, echo (<= 10 s)": lambda: foreign_holder("echo"),
        "bound, not listening (< 2 s)": bound_not_listening,
        "free port + port 0 (< 1 s)": free_port_and_zero,
        "remote, nobody listening (< 5 s)": remote_nobody,
        "another job's store (<= 10 s)": lambda: store_case("torch.rendezvous.jobA", "jobB"),
        f"empty store (>= {EMPTY_STORE_GRACE_S:g} s grace)": lambda: store_case(None, "jobA"),
    }
    for name, case in cases.items():
        runs = [case() for _ in range(args.repeats)]
        times = [t for t, _ in runs]
        print(f"{name:<40} median {statistics.median(times):6.2f} s  max {max(times):6.2f} s  "
              f"verdict: {runs[-1][1]}")


if __name__ == "__main__":
    main()
