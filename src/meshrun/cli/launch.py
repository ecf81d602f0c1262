"""`meshrun launch [torchrun options] script.py [args]`: see `meshrun launch --help`."""

from __future__ import annotations

import signal
import sys

from meshrun.launch.args import build_parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)  # torch-free: a mistyped option is one line, at once
    from meshrun.launch.launcher import run_launch  # torch
    from meshrun.launch.torch_elastic import SignalException

    try:
        return run_launch(args)
    except SignalException as exc:  # SIGTERM/SIGINT/SIGHUP to the agent: it has stopped the workers
        name = signal.Signals(exc.sigval).name
        print(f"meshrun launch: stopped by {name}; the workers were stopped too (exit {128 + exc.sigval})",
              file=sys.stderr)
        return 128 + int(exc.sigval)
