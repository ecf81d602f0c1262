"""How fast this machine is today, in two figures that do not depend on meshrun's code.

    python benchmarks/yardstick.py

The suite's 10-minute budget was set, and met (568 s), on a machine where the same code later took
1,483 s (the tree of that run, re-run: `git worktree add /tmp/old 9fab460`, its suite alone). A
suite time means little without the machine's speed beside it; `.ci/run` prints this line before
`make test`, so two CI logs compare like with like:
- `import torch`: CPU seconds of a fresh `python -c "import torch"` (median of --repeats), what
  every rank and every `meshrun` process pays first;
- a pure-Python loop of 10**7 additions, CPU seconds (median), the interpreter's own speed.
Each child is bounded by --timeout and killed by pid past it.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

LOOP = "x = 0\nfor i in range(10_000_000):\n    x += i\n"


def _child_cpu(code: str, timeout: float) -> float:
    """CPU seconds (user + sys) of `python -c code`, run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # by its pid
        proc.wait()
        raise SystemExit(f"yardstick: `python -c {code.splitlines()[0]!r}` took over {timeout:.0f} s") from None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each figure (median; default 3)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take (default 120)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    torch_s = statistics.median(_child_cpu("import torch", args.timeout) for _ in range(max(1, args.repeats)))
    loop_s = statistics.median(_child_cpu(LOOP, args.timeout) for _ in range(max(1, args.repeats)))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine yardstick: import torch {torch_s:.2f} CPU-s, 10**7-step Python loop {loop_s:.2f} CPU-s "
          f"(medians of {max(1, args.repeats)}; load average {load:.2f}; {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
