"""The `meshrun launch` command line: every torchrun flag, plus meshrun's own, with its defaults."""

from __future__ import annotations

import argparse
import os

from meshrun.errors import LaunchError
from meshrun.runtime.device import auto_nproc_per_node

LAUNCH_DESCRIPTION = """\
Start N copies of a training script, one per device, the way torchrun does (its elastic agent
runs underneath, so every torchrun flag works with the same name and meaning), and add:

  * --nproc-per-node defaults to auto: one process per GPU, or 2-4 CPU processes (gloo)
  * a free rendezvous port on a single node, so two jobs at once never collide
  * every line of output prefixed [rank N] (or only rank 0's with --rank0-only)
  * per-rank logs on disk, and on failure a summary naming the rank that failed first,
    its exit code or signal, the exception with file:line and its last lines of output
  * --max-restarts that recovers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), each failed attempt
    printed and kept in <log-dir>/failures.log
  * several nodes: the store host, node address and gloo/NCCL interface from this machine's
    routes; under SLURM, --nnodes and --rdzv-* from SLURM_* (docs/multinode.md)
"""

LAUNCH_EPILOG = """\
examples:
  meshrun launch train.py                          # auto: GPUs, else 2-4 CPU processes
  meshrun launch --nproc-per-node 4 train.py --lr 1e-3
  meshrun launch --nproc-per-node 2 -m mypkg.train  # run a module, like python -m
  meshrun launch --nnodes 2 --nproc-per-node 8 --rdzv-id job1 \\
      --rdzv-backend c10d --rdzv-endpoint HOST:29400 train.py   # on every node

Workers get RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as under torchrun;
scripts may call meshrun.init() to pick the device and backend for them.
"""

# Most CPU runs gain nothing past a few gloo processes, and each one holds a full model copy.
NPROC_KEYWORDS = ("cpu", "gpu", "xpu")  # torchrun's own spellings for "one per device of that kind"
MAX_NPROC_PER_NODE = 4096  # more worker processes than any node runs: a typo, not a plan
MAX_NNODES = 1_000_000


def check_nproc_per_node(value: str) -> str:
    """`--nproc-per-node` as given: 'auto', a number 1-MAX_NPROC_PER_NODE, or cpu/gpu/xpu (no torch)."""
    value = str(value).strip()
    if value == "auto" or value in NPROC_KEYWORDS:
        return value
    if value.lstrip("-").isdigit() and not 1 <= int(value) <= MAX_NPROC_PER_NODE:
        raise LaunchError(f"--nproc-per-node {value}: must be 'auto' or 1-{MAX_NPROC_PER_NODE} "
                          f"(e.g. --nproc-per-node 2)")
    if not value.isdigit():
        raise LaunchError(f"--nproc-per-node {value!r}: expected 'auto', a number >= 1, or cpu/gpu/xpu")
    return value


def resolve_nproc_per_node(value: str) -> str:
    """`auto` is meshrun's (see auto_nproc_per_node); anything else means what it means to torchrun."""
    value = check_nproc_per_node(value)
    return str(auto_nproc_per_node()) if value == "auto" else value


def parse_nnodes(text: str | int) -> tuple[int, int]:
    """`--nnodes N` or `MIN:MAX` (torchrun's spelling) -> (min, max), or one LaunchError naming the fix."""
    raw = str(text).strip()
    low, sep, high = raw.partition(":")
    if not sep:
        high = low
    if not (low.isdigit() and high.isdigit()) or ":" in high or not 0 < int(low) <= int(high) <= MAX_NNODES:
        raise LaunchError(f"--nnodes={raw!r} must be N or MIN:MAX with 1 <= MIN <= MAX, "
                          f"e.g. --nnodes 2 or --nnodes 1:4")
    return int(low), int(high)


def fixed_nnodes(text: str | int) -> int | None:
    """N for `--nnodes N` or `N:N`; None for an elastic MIN:MAX range (LaunchError when malformed)."""
    low, high = parse_nnodes(text)
    return low if low == high else None


def fixed_world_size(nproc_per_node: str, nnodes: str) -> int | None:
    """nproc_per_node x nnodes when both are fixed numbers; None for 'auto', cpu/gpu counts or
    an elastic MIN:MAX node range (the world is known only at launch)."""
    nodes = fixed_nnodes(str(nnodes))
    nproc = str(nproc_per_node).strip()
    if not nproc.isdigit() or nodes is None:
        return None
    return int(nproc) * nodes


def build_parser(prog: str = "meshrun launch") -> argparse.ArgumentParser:
    """torchrun's own parser, re-labelled, with meshrun's defaults and options added."""
    from meshrun.launch.torchrun_flags import (
        torchrun_parser,  # torch's flags, without importing torch
    )

    parser = torchrun_parser()
    parser.prog = prog
    parser.description = LAUNCH_DESCRIPTION
    parser.epilog = LAUNCH_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if action.dest == "nproc_per_node":
            action.default = os.environ.get("PET_NPROC_PER_NODE", "auto")
            action.help = (
                "Worker processes per node: auto (default: one per GPU, else 2-4 on CPU), "
                "an integer, or cpu/gpu/xpu as in torchrun."
            )
        elif action.dest == "log_dir":
            action.help = (
                "Directory for per-rank logs (stdout.log, stderr.log, error.json per rank and "
                "attempt). Default: a new directory under the system temp dir, printed on failure."
            )
    group = parser.add_argument_group("meshrun options")
    group.add_argument(
        "--rank0-only",
        action="store_true",
        help="Show only local rank 0's output on the console; every rank still logs to --log-dir.",
    )
    group.add_argument(
        "--no-prefix",
        action="store_true",
        help="Do not prefix output lines with [rank N].",
    )
    group.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="Hang watchdog: when no rank makes progress (a collective, an optimizer step, "
        "meshrun.heartbeat()) for this long, print every rank's stack and last collectives and fail "
        "the job. 0 = off. Collective timeouts become 2x this (docs/diagnose.md). "
        "Default: $MESHRUN_HANG_TIMEOUT, else 300.",
    )
    group.add_argument(
        "--verbose",
        action="store_true",
        help="Show every frame of a failure: C++ stacks and meshrun's own frames, which are left out by default.",
    )
    group.add_argument(
        "--debug",
        choices=["collectives"],
        default=os.environ.get("MESHRUN_DEBUG") or None,
        help="collectives: compare every collective's op, shapes and call site across ranks before "
        "it runs; the first divergence stops the job, naming the rank and file:line.",
    )
    return parser
