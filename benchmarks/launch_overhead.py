"""Launch overhead: time from the launch command to the first line of user code, meshrun vs torchrun.

    python benchmarks/launch_overhead.py --repeats 15 --nproc-per-node 2
    python benchmarks/launch_overhead.py --repeats 15 --before /tmp/old/src   # also an older meshrun

Both launchers start the same 2-process script, alternating run by run so machine noise hits
both alike. The script's first line records time.time(); the figure per run is the latest
rank's first line minus the moment the launcher was started. Prints the medians, the ratio
meshrun / torchrun (target <= 1.05), and the median of per-round ratios (steadier when the
machine's load swings). --before SRC adds a third launcher, `meshrun launch` with
PYTHONPATH=SRC (e.g. `git archive HEAD~1 src | tar -x -C /tmp/old`), interleaved with the
other two, to measure a change. Every run is bounded by --timeout and killed by pid.

On a loaded machine the end-to-end ratio cannot resolve a few percent (torch's c10d rendezvous
alone sleeps a random 0-0.3 s in its first round). --components also times, as the minimum of
--repeats runs, the two parts meshrun adds, each in isolation: the worker bootstrap
(worker_main.py before a script's first line, against plain `python script.py`) and meshrun's
own imports in the launcher (torch already imported).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

FIRST_LINE_SCRIPT = """\
import os, time; _t = time.time()
with open(os.path.join(os.environ["BENCH_DIR"], "rank" + os.environ["RANK"]), "w") as fp:
    fp.write(repr(_t))
"""


TARGET_RATIO = 1.05


def _launcher_cmd(name: str, nproc: int, script: str) -> list[str]:
    bindir = os.path.dirname(sys.executable)
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), script]
    if name == "before":  # an older src/ may lack the console script's entry point: `python -m meshrun`
        return [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", str(nproc), script]
    meshrun = shutil.which("meshrun", path=bindir) or "meshrun"
    return [meshrun, "launch", "--nproc-per-node", str(nproc), script]


def time_to_first_line(name: str, nproc: int, script: str, timeout: float, before: str | None = None) -> float:
    with tempfile.TemporaryDirectory() as bench_dir:
        env = dict(os.environ, BENCH_DIR=bench_dir)
        if name == "before":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [before, env.get("PYTHONPATH")]))
        start = time.time()
        proc = subprocess.Popen(_launcher_cmd(name, nproc, script), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise SystemExit(f"{name} did not finish within {timeout}s") from None
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed with exit code {proc.returncode}:\n{err.decode()[-2000:]}")
        stamps = []
        for rank in range(nproc):
            with open(os.path.join(bench_dir, f"rank{rank}")) as fp:
                stamps.append(float(fp.read()))
        return max(stamps) - start


COMPONENT_IMPORTS = ("import time, torch, torch.distributed.run, torch.distributed.launcher.api; "
                     "t = time.perf_counter(); import meshrun.cli.launch, meshrun.launch.launcher; "
                     "print(time.perf_counter() - t)")


def components(repeats: int, src: str | None) -> dict[str, float]:
    """Minimum seconds of: plain python, the worker bootstrap, meshrun's launcher imports."""
    worker_main = os.path.join(src or os.path.dirname(os.path.dirname(os.path.abspath(__import__("meshrun").__file__))),
                               "meshrun", "launch", "worker_main.py")
    env = dict(os.environ, MESHRUN_HANG_TIMEOUT="300", TORCHELASTIC_RUN_ID="bench", RANK="0")
    if src:
        env["PYTHONPATH"] = src
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "first_line.py")
        with open(script, "w") as fp:
            fp.write("import time\n")
        found: dict[str, list[float]] = {"plain python": [], "worker bootstrap": [], "launcher imports": []}
        for _ in range(repeats):
            for name, cmd in (("plain python", [sys.executable, "-u", script]),
                              ("worker bootstrap", [sys.executable, "-u", worker_main, script])):
                start = time.perf_counter()
                subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True, timeout=60)
                found[name].append(time.perf_counter() - start)
            out = subprocess.run([sys.executable, "-c", COMPONENT_IMPORTS], env=env, capture_output=True,
                                 text=True, check=True, timeout=120).stdout
            found["launcher imports"].append(float(out))
    return {name: min(values) for name, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per launcher (alternating)")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--before", metavar="SRC", help="also time `meshrun launch` from this src directory")
    parser.add_argument("--components", action="store_true",
                        help="only time meshrun's own parts in isolation (minimum of --repeats runs)")
    args = parser.parse_args()
    if args.components:
        for label, src in [("meshrun", None)] + ([(f"meshrun from {args.before}", args.before)] if args.before else []):
            found = components(args.repeats, src)
            extra = found["worker bootstrap"] - found["plain python"]
            print(f"{label}: worker bootstrap adds {extra * 1e3:.1f} ms to a script's first line "
                  f"(plain python {found['plain python'] * 1e3:.1f} ms); launcher imports "
                  f"{found['launcher imports'] * 1e3:.1f} ms on top of torch's")
        return

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "first_line.py")
        with open(script, "w") as fp:
            fp.write(FIRST_LINE_SCRIPT)
        names = ["torchrun", "meshrun"] + (["before"] if args.before else [])
        times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:  # warm caches
            time_to_first_line(name, args.nproc_per_node, script, args.timeout, args.before)
        for i in range(args.repeats):
            order = names[i % len(names):] + names[:i % len(names)]  # each launcher leads in turn
            for name in order:
                times[name].append(time_to_first_line(name, args.nproc_per_node, script, args.timeout, args.before))
    for name, values in times.items():
        print(f"{name:>9}: median {statistics.median(values):.3f} s  "
              f"(runs: {', '.join(f'{v:.3f}' for v in values)})")
    torchrun = statistics.median(times["torchrun"])
    for name in names[1:]:
        label = "meshrun" if name == "meshrun" else f"meshrun from {args.before}"
        # Per-round ratios pair runs made seconds apart, so that slow swings of a shared machine's
        # load cancel; the ratio of medians is the headline figure.
        paired = statistics.median(m / t for m, t in zip(times[name], times["torchrun"], strict=True))
        print(f"ratio {label}/torchrun: {statistics.median(times[name]) / torchrun:.3f} "
              f"(median of per-round ratios {paired:.3f}; target <= {TARGET_RATIO})")


if __name__ == "__main__":
    main()
