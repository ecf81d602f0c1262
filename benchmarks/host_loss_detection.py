"""How fast a lost host is detected, and how often a loaded one is wrongly dropped: two loopback nodes.

    python benchmarks/host_loss_detection.py                          # 3 kills, then 3 minutes under a CPU hog
    python benchmarks/host_loss_detection.py --kills 1 --minutes 1 --torch-too

Detection: two `meshrun launch` nodes (`--nnodes 1:2`, one worker each, c10d on loopback) step
an all_reduce every 0.2 s; node 1's agent and worker are SIGKILLed, and the figure is the time
from the kill to node 0's first step alone (world 1), with meshrun's rendezvous defaults
(src/meshrun/launch/rdzv_defaults.py) and, with --torch-too, torch's (5 s x 3, last call 30 s).
False alarms: the same pair, nobody killed, for --minutes beside --hogs busy processes per node;
every restart is a false alarm. All processes are started and ended by pid.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
TORCH_DEFAULTS = "keep_alive_interval=5,keep_alive_max_attempt=3,last_call_timeout=30"
LOOP = """\
import os, sys, time
import torch, torch.distributed as dist
import meshrun

env = meshrun.init()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
end = time.time() + float(sys.argv[1])
step = 0
while time.time() < end:
    x = torch.ones(1)
    dist.all_reduce(x)
    step += 1
    print(f"step {step} attempt={attempt} world={env.world_size} t={time.time():.3f}", flush=True)
    time.sleep(0.2)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    children: dict[int, list[int]] = {}
    for child, parent in zip(out[::2], out[1::2], strict=True):
        children.setdefault(int(parent), []).append(int(child))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def _kill(pid: int) -> None:
    for p in reversed(_tree(pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pair(work: Path, seconds: float, conf: str | None, tag: str) -> tuple[list[subprocess.Popen], list[Path]]:
    script = work / "loop.py"
    script.write_text(LOOP)
    port = _free_port()
    args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", tag, "--max-restarts", "3"]
    if conf:
        args += ["--rdzv-conf", conf]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    for node in (0, 1):
        logs.append(work / f"{tag}-{node}.log")
        procs.append(subprocess.Popen([str(BIN / "meshrun"), "launch", *args, str(script), str(seconds)], cwd=work,
                                      env=env, stdout=logs[-1].open("w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
        if node == 0:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.2)
    return procs, logs


def _steps(log: Path) -> list[tuple[int, int, float]]:
    return [(int(a), int(w), float(t)) for a, w, t in
            re.findall(r"\[rank 0\] step \d+ attempt=(\d+) world=(\d) t=([\d.]+)", log.read_text())]


def detect(work: Path, conf: str | None, tag: str) -> float | None:
    procs, logs = _pair(work, 120, conf, tag)
    try:
        deadline = time.monotonic() + 90
        while not any(w == 2 for _, w, _ in _steps(logs[0])[-1:]) or len(_steps(logs[0])) < 5:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                return None
            time.sleep(0.2)
        killed = time.time()
        _kill(procs[1].pid)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            alone = [t for a, w, t in _steps(logs[0]) if w == 1 and t > killed]
            if alone:
                return alone[0] - killed
            time.sleep(0.1)
        return None
    finally:
        for p in procs:
            _kill(p.pid)


def false_alarms(work: Path, minutes: float, hogs: int, tag: str) -> tuple[int, int]:
    """(restarts, steps) of an undisturbed pair beside `hogs` busy processes per node."""
    hog = [subprocess.Popen([sys.executable, "-c", "import time\nend=time.time()+%f\nwhile time.time()<end: pass"
                             % (minutes * 60 + 60)], start_new_session=True) for _ in range(2 * hogs)]
    procs, logs = _pair(work, minutes * 60, None, tag)
    try:
        for p in procs:
            p.wait(timeout=minutes * 60 + 180)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in [*procs, *hog]:
            _kill(p.pid)
    rows = [r for log in logs for r in _steps(log)]
    restarts = sum(log.read_text().count("restarting (restart") for log in logs)
    return restarts + len({a for a, _, _ in rows if a > 0}), len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3, help="host kills timed with meshrun's defaults")
    parser.add_argument("--torch-too", action="store_true", help="also time one kill with torch's defaults")
    parser.add_argument("--minutes", type=float, default=3.0, help="false-alarm run length; 0 = skip")
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside each node in that run")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        times = [detect(work, None, f"detect{i}") for i in range(args.kills)]
        ok = [t for t in times if t is not None]
        if ok:
            print(f"meshrun defaults: host SIGKILL -> survivor's first step alone: median {statistics.median(ok):.1f}s "
                  f"({min(ok):.1f}-{max(ok):.1f}), {len(ok)}/{len(times)} detected", flush=True)
        if args.torch_too:
            t = detect(work, TORCH_DEFAULTS, "detect-torch")
            print(f"torch defaults ({TORCH_DEFAULTS}): {t if t is None else round(t, 1)}s", flush=True)
        if args.minutes > 0:
            restarts, steps = false_alarms(work, args.minutes, args.hogs, "quiet")
            print(f"false alarms: {restarts} restart(s) in {args.minutes:g} min, {steps} steps, "
                  f"{args.hogs} CPU hogs per node, load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
