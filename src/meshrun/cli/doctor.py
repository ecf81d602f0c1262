"""`meshrun doctor [--json] [--skip-smoke] [--port P] [--timeout S]`: is this machine ready?

This module parses arguments and formats; the checks live in `meshrun.doctor`.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from meshrun.argparser import Parser

DESCRIPTION = """\
Check this machine for distributed PyTorch training and say how to fix what is wrong.

checked, in order:
  install   torch version and build (CPU/CUDA), accelerators, torch.distributed,
            the gloo / NCCL / MPI backends (no NCCL on a CPU machine is only INFO)
  machine   the hostname resolves (127.x is a multi-node trap), loopback TCP works,
            /dev/shm is large enough (docker's 64 MiB default is not)
  env       stale or malformed RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT,
            NCCL_* variables that slow every job, OMP_NUM_THREADS
  smoke     a live 2-process gloo all_reduce (and NCCL with >= 2 GPUs) on loopback, in a
            clean environment, with its median latency; killed after --timeout

Each check is PASS, WARN, FAIL or INFO; every non-PASS check comes with a one-line fix.
"""

EPILOG = """\
examples:
  meshrun doctor                      # full report, live test on a free port (or $MASTER_PORT)
  meshrun doctor --skip-smoke         # static checks only, about a second plus torch import
  meshrun doctor --port 29500         # run the live test on the port your jobs will use
  meshrun doctor --json | jq '.checks[] | select(.status == "FAIL")'

exit status: 0 when no check FAILs (warnings allowed), 1 when any check FAILs, 2 on bad options.
"""

STATUS_WIDTH = 6


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer port") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {value:g}")
    return value


def build_parser(prog: str = "meshrun doctor") -> argparse.ArgumentParser:
    parser = Parser(
        prog=prog, description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true",
                        help="Print the checks and the summary as one JSON object on stdout, nothing else.")
    parser.add_argument("--skip-smoke", action="store_true",
                        help="Skip the live 2-process all_reduce test (it is reported as INFO).")
    parser.add_argument("--port", type=_port, default=None,
                        help="TCP port for the live test's rendezvous. Default: $MASTER_PORT when set "
                             "and valid, else a free port. A busy port fails the check with who holds it.")
    parser.add_argument("--timeout", type=_seconds, default=60.0,
                        help="Seconds the live test may take in all, process start-up included, before "
                             "every worker is killed (default: 60).")
    return parser


def format_table(report, summary: dict[str, object], width: int = 100) -> str:
    """CHECK / STATUS / DETAIL rows, each non-PASS check followed by its one-line fix, then the verdict."""
    name_width = max([len("CHECK"), *(len(check.name) for check in report)])
    indent = " " * (name_width + STATUS_WIDTH + 4)
    wrap = max(40, width - len(indent))
    lines = [f"{'CHECK':<{name_width}}  {'STATUS':<{STATUS_WIDTH}}  DETAIL"]
    for check in report:
        detail = textwrap.wrap(check.detail, wrap) or [""]
        lines.append(f"{check.name:<{name_width}}  {check.status:<{STATUS_WIDTH}}  {detail[0]}")
        lines.extend(indent + more for more in detail[1:])
        if check.status != "PASS" and check.fix:
            lines.append(f"{indent}fix: {check.fix}")  # never wrapped: one line to copy or grep
    lines.append("")
    lines.append(f"verdict: {summary['verdict']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from meshrun.doctor import run_checks, summarize

    def progress(backend: str) -> None:
        if not args.json:
            print(f"meshrun doctor: running a 2-process {backend} all_reduce (timeout {args.timeout:g} s)...",
                  file=sys.stderr, flush=True)

    report = run_checks(port=args.port, timeout=args.timeout, skip_smoke=args.skip_smoke, on_smoke=progress)
    summary = summarize(report)
    if args.json:
        print(json.dumps({"checks": [check.to_dict() for check in report], "summary": summary}, indent=2))
    else:
        print(format_table(report, summary))
    return 0 if summary["ok"] else 1
