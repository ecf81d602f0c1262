"""Launch failure latency: seconds from `meshrun launch` to its exit when the job cannot run or fails.

    python benchmarks/launch_failures.py --repeats 3

The end-to-end tests check what each failure reports; how long it takes is measured here, where
the machine's load cannot fail CI. Each figure is the median of --repeats runs, end to end (the
CLI importing torch included):
1. A program that accepts connections and never answers holds the --rdzv-endpoint port: seconds
   until the one-line refusal (torch alone hangs with no message).
2. Another job's running c10d store is on the endpoint (a different --rdzv-id): seconds until the
   refusal (torch alone joins the other job's store).
3. One rank calls sys.exit(3) right after meshrun.init(): seconds until the job has ended (the
   failing rank must not sit in the shutdown barrier).
4. One rank raises at step 3 of an all_reduce loop: seconds until the job has ended with the summary.
Every process is started in a session of its own and killed by its group id on the way out.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

MESHRUN = os.path.join(os.path.dirname(sys.executable), "meshrun")
SILENT_HOLDER = """\
import socket, time
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(8)
print(sock.getsockname()[1], flush=True)
conns, deadline = [], time.monotonic() + 300
while time.monotonic() < deadline:  # accept and never answer, like a stuck server
    sock.settimeout(1)
    try:
        conns.append(sock.accept()[0])
    except OSError:
        pass
"""
SLEEPER = "import time\ntime.sleep(300)\n"
NOOP = "print('never runs')\n"
EXITS = "import sys, meshrun\nenv = meshrun.init()\nif env.rank == 1:\n    sys.exit(3)\nprint('done')\n"
RAISES = """\
import torch, torch.distributed as dist
import meshrun

env = meshrun.init()
for step in range(20):
    if env.rank == 1 and step == 3:
        raise ValueError(f"bad batch at step {step}")
    dist.all_reduce(torch.ones(4))
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}


def _popen(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def _timed(cmd: list[str], timeout: float, expect: str) -> float:
    start = time.monotonic()
    proc = _popen(cmd)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise SystemExit(f"{' '.join(cmd)} did not end within {timeout}s") from None
    if expect not in err:
        raise SystemExit(f"{' '.join(cmd)}: expected {expect!r} in its stderr:\n{err[-2000:]}")
    return time.monotonic() - start


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rdzv(endpoint: str, rdzv_id: str) -> list[str]:
    return [MESHRUN, "launch", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]


def held_port(tmp: str, timeout: float) -> float:
    holder = _popen([sys.executable, "-c", SILENT_HOLDER])
    try:
        port = int(holder.stdout.readline())
        return _timed([*_rdzv(f"127.0.0.1:{port}", "job1"), os.path.join(tmp, "noop.py")], timeout,
                      f"port {port} is held by pid")
    finally:
        _stop(holder)


def other_job(tmp: str, timeout: float) -> float:
    endpoint = f"127.0.0.1:{_free_port()}"
    job_a = _popen([*_rdzv(endpoint, "jobA"), os.path.join(tmp, "sleeper.py")])
    try:
        deadline = time.monotonic() + timeout
        while True:  # job A's store is up once its port accepts connections
            if job_a.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"job A never started its store: {job_a.communicate()}")
            try:
                with socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])), timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        time.sleep(2)  # and its agent has registered the job
        return _timed([*_rdzv(endpoint, "jobB"), os.path.join(tmp, "sleeper.py")], timeout,
                      "is already used by another job")
    finally:
        _stop(job_a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run before it is killed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, source in (("noop.py", NOOP), ("sleeper.py", SLEEPER), ("exits.py", EXITS),
                             ("raises.py", RAISES)):
            with open(os.path.join(tmp, name), "w") as fp:
                fp.write(source)
        two = [MESHRUN, "launch", "--nproc-per-node", "2"]
        figures = {
            "rdzv port held by a silent program: seconds to the refusal": lambda: held_port(tmp, args.timeout),
            "another job's store on the endpoint: seconds to the refusal": lambda: other_job(tmp, args.timeout),
            "sys.exit(3) on rank 1: seconds to the job's end": lambda: _timed(
                [*two, os.path.join(tmp, "exits.py")], args.timeout, "Rank 1 failed first"),
            "rank 1 raises at step 3: seconds to the job's end": lambda: _timed(
                [*two, os.path.join(tmp, "raises.py")], args.timeout, "failed first"),
        }
        for label, measure in figures.items():
            values = [measure() for _ in range(args.repeats)]
            print(f"{label}: median {statistics.median(values):.1f} (runs: {', '.join(f'{v:.1f}' for v in values)})",
                  flush=True)


if __name__ == "__main__":
    main()
