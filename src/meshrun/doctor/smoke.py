"""The live check: 2 real processes, a process group and timed all_reduces, bounded by a timeout.

The parent (`run_smoke`) starts `python -m meshrun.doctor.smoke` twice with a clean launcher
environment (the user's stale RANK/WORLD_SIZE/MASTER_* never reach the workers) and kills every
worker by pid if they have not finished in time. Rank 0 prints one result line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

from meshrun.doctor.checks import FAIL, PASS, WARN, Check
from meshrun.launch.ports import describe_busy_port, free_port, port_in_use

WORLD_SIZE = 2
WARMUP = 5
ITERS = 20
NUMEL = 256  # 1 KiB of float32: latency, not bandwidth
RESULT_MARK = "MESHRUN_SMOKE_RESULT "
POLL_S = 0.05
# The directory holding the `meshrun` package: workers import this same copy of it.
SRC_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What a launcher sets per worker; removed so workers see only what run_smoke sets.
_LAUNCHER_VARS = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
}


def choose_port(port: int | None, environ: Mapping[str, str]) -> tuple[int, str]:
    """(port, where it came from): --port, else a valid MASTER_PORT, else a free port."""
    if port is not None:
        return port, "--port"
    raw = environ.get("MASTER_PORT", "").strip()
    if raw.isascii() and raw.isdigit() and 0 < int(raw) <= 65535:
        return int(raw), "MASTER_PORT"
    return free_port(), "free"


def worker_env(environ: Mapping[str, str], *, rank: int, port: int) -> dict[str, str]:
    """The user's environment minus launcher leftovers, plus this worker's own launch variables."""
    env = {
        k: v for k, v in environ.items()
        if k not in _LAUNCHER_VARS and not k.startswith(("TORCHELASTIC_", "PET_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC_DIR, env.get("PYTHONPATH")]))
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",  # as torchrun does; two processes on few cores otherwise crawl
    )
    return env


def _tail(fp, limit: int = 240) -> str:
    fp.seek(0)
    lines = [line.strip() for line in fp.read().decode(errors="replace").splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(RESULT_MARK)]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return (errors or lines or ["no output"])[-1][:limit]


def _result(out_fp) -> dict | None:
    out_fp.seek(0)
    for line in out_fp.read().decode(errors="replace").splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    return None


def _wait(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for all to exit; stop early when one fails. False on timeout."""
    while True:
        codes = [p.poll() for p in procs]
        if all(code is not None for code in codes):
            return True
        if any(code not in (None, 0) for code in codes):
            return True  # a peer failed: the rest would only wait for the group timeout
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)


def run_smoke(
    backend: str = "gloo",
    *,
    port: int | None = None,
    timeout: float = 60.0,
    environ: Mapping[str, str] | None = None,
) -> Check:
    """Start 2 workers, all_reduce, and report the median latency or why it failed."""
    environ = os.environ if environ is None else environ
    chosen, source = choose_port(port, environ)
    check = _run_once(backend, chosen, source, timeout, environ)
    if source == "free" and check.status == FAIL and "EADDRINUSE" in check.detail:
        # Another program took the free port between free_port() and the store's bind: try once more.
        check = _run_once(backend, free_port(), source, timeout, environ)
    return check


def _run_once(backend: str, port: int, source: str, timeout: float, environ: Mapping[str, str]) -> Check:
    name = f"smoke {backend}"
    where = {"--port": "", "MASTER_PORT": " (from MASTER_PORT)"}.get(source, " (picked free)")
    if port < 1024 and hasattr(os, "geteuid") and os.geteuid() != 0:
        return Check(name, FAIL, f"not started: port {port}{where} is privileged",
                     f"pass --port N with N >= 1024 (e.g. --port {free_port()})")
    if port_in_use(port):
        unset = " or `unset MASTER_PORT`" if source == "MASTER_PORT" else ""
        return Check(name, FAIL, f"not started: port {port}{where} is busy",
                     f"{describe_busy_port(port)}; pass --port N (e.g. --port {free_port()}){unset} or free it")
    start = time.monotonic()
    procs: list[subprocess.Popen] = []
    outputs = [tempfile.TemporaryFile() for _ in range(WORLD_SIZE)]
    try:
        for rank in range(WORLD_SIZE):
            cmd = [sys.executable, "-m", "meshrun.doctor.smoke", backend, str(timeout)]
            env = worker_env(environ, rank=rank, port=port)
            procs.append(subprocess.Popen(cmd, env=env, cwd=SRC_DIR, stdin=subprocess.DEVNULL,
                                          stdout=outputs[rank], stderr=subprocess.STDOUT))
        finished = _wait(procs, start + timeout)
        if not finished:
            return Check(name, FAIL, f"{WORLD_SIZE} processes on port {port}{where} did not finish within "
                         f"{timeout:g} s; rank 0's last output: {_tail(outputs[0])}",
                         "check that nothing blocks local TCP (firewall, GLOO_SOCKET_IFNAME), or raise --timeout")
        return _verdict(name, procs, outputs, port, time.monotonic() - start)
    finally:
        for proc in procs:  # killed by pid, each one, whatever happened above
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for fp in outputs:
            fp.close()


def _verdict(name: str, procs: list[subprocess.Popen], outputs: list, port: int, elapsed: float) -> Check:
    failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode not in (None, 0)]
    result = _result(outputs[0])
    if result is not None:
        detail = (f"{WORLD_SIZE} ranks on port {port}: median {result['median_ms']:.3f} ms per {NUMEL * 4 // 1024} KiB "
                  f"all_reduce (min {result['min_ms']:.3f}, max {result['max_ms']:.3f}, n={ITERS}); {elapsed:.1f} s in all")
        if not failed:
            return Check(name, PASS, detail)
        rank, code = failed[0]
        return Check(name, WARN, f"{detail}; but rank {rank} exited with code {code} at teardown",
                     "collectives work; a crash at exit is teardown: meet at dist.barrier() before "
                     f"dist.destroy_process_group() (meshrun.shutdown() does) [{_tail(outputs[rank])}]")
    if not failed:
        return Check(name, FAIL, f"workers exited without a result: {_tail(outputs[0])}",
                     "rerun `meshrun doctor`; if it repeats, report it with this output")
    rank, code = failed[0]
    error = _tail(outputs[rank])
    fix = "fix the error shown; if it names an address, check loopback and GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME"
    if "EADDRINUSE" in error:
        fix = f"port {port} was taken while the workers started; pass --port N (e.g. --port {free_port()}) or rerun"
    return Check(name, FAIL, f"rank {rank} exited with code {code}: {error}", fix)


def _worker(backend: str, timeout: float) -> None:
    """One rank of the smoke test; the launch variables come from worker_env."""
    import statistics
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    x = torch.empty(NUMEL, device=device)
    times = []
    for i in range(WARMUP + ITERS):
        x.fill_(rank + 1)
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        sync()
        if i >= WARMUP:
            times.append((time.perf_counter() - t0) * 1e3)
    expected = WORLD_SIZE * (WORLD_SIZE + 1) / 2
    if not torch.all(x == expected):
        raise RuntimeError(f"all_reduce gave {x[0].item()}, expected {expected}")
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        stats = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
        print(RESULT_MARK + json.dumps(stats), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], float(sys.argv[2]))
