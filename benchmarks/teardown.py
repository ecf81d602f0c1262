"""Teardown reliability: how often a 4-process DDP job on gloo fails at exit, meshrun vs torch by hand.

    python benchmarks/teardown.py --repeats 20 --nproc-per-node 4

The same small DDP loop runs under `meshrun launch` (meshrun.init(), whose shutdown frees the
model, meets at a barrier and destroys the group) and under torchrun as the guide writes it
(init_process_group, no cleanup), alternating run by run so machine noise hits both alike. A run
fails when the launcher exits non-zero, a worker prints `terminate called`, or a rank never
printed "rank-done". Prints failures out of --repeats and the median seconds per run for each; the field
notes measured torch by hand failing 5 of 10 runs at 4 processes. tests/e2e/test_teardown.py runs
the meshrun half a few times in CI (MESHRUN_TEARDOWN_RUNS). Every run is bounded by --timeout and
its whole process group is killed when it passes.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

LOOP = """\
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(8, 10)).sum().backward()
    opt.step()
print("rank-done", flush=True)
"""
HEADER = """\
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
"""
SCRIPTS = {
    "meshrun": HEADER + "import meshrun\n\nmeshrun.init()\n" + LOOP,
    "torch": HEADER + "\ndist.init_process_group('gloo')\n" + LOOP,
}


def _command(name: str, nproc: int, script: str) -> list[str]:
    if name == "torch":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), script]
    return [os.path.join(os.path.dirname(sys.executable), "meshrun"), "launch", "--nproc-per-node", str(nproc),
            script]


def run_once(name: str, nproc: int, script: str, timeout: float) -> tuple[bool, float, str]:
    """(clean, seconds, output tail) for one launch."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    start = time.perf_counter()
    proc = subprocess.Popen(_command(name, nproc, script), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return False, time.perf_counter() - start, f"timed out after {timeout}s\n{out[-1500:]}"
    seconds = time.perf_counter() - start
    # count a marker, not lines: torchrun does not prefix ranks, so their lines may interleave
    clean = proc.returncode == 0 and "terminate called" not in out and out.count("rank-done") >= nproc
    return clean, seconds, out[-1500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="runs per launcher (alternating)")
    parser.add_argument("--nproc-per-node", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--only", choices=sorted(SCRIPTS), help="run one side only")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each failed run's output")
    args = parser.parse_args()

    names = [args.only] if args.only else ["meshrun", "torch"]
    failures: dict[str, int] = dict.fromkeys(names, 0)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name in names:
            paths[name] = os.path.join(tmp, f"ddp_{name}.py")
            with open(paths[name], "w") as fp:
                fp.write(SCRIPTS[name])
        for i in range(args.repeats):
            for name in names if i % 2 == 0 else names[::-1]:
                clean, took, tail = run_once(name, args.nproc_per_node, paths[name], args.timeout)
                seconds[name].append(took)
                if not clean:
                    failures[name] += 1
                    if args.verbose:
                        print(f"--- {name} run {i} failed:\n{tail}", flush=True)
    for name in names:
        print(f"{name:>8}: {failures[name]} of {args.repeats} runs failed at {args.nproc_per_node} processes; "
              f"median {statistics.median(seconds[name]):.2f} s per run")


if __name__ == "__main__":
    main()
