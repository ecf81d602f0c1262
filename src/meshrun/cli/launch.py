"""`meshrun launch [torchrun options] script.py [args]`: see `meshrun launch --help`."""

from __future__ import annotations

import signal
import sys

from meshrun.launch.args import build_parser
from meshrun.launch.launcher import run_launch


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)  # torch-free, as are the checks: a mistake is one line, at once
    try:
        return run_launch(args)
    except Exception as exc:
        elastic = sys.modules.get("meshrun.launch.torch_elastic")  # not imported: no signal came through it
        if elastic is None or not isinstance(exc, elastic.SignalException):
            raise
        # SIGTERM/SIGINT/SIGHUP to the agent: it has stopped the workers
        name = signal.Signals(exc.sigval).name
        print(f"meshrun launch: stopped by {name}; the workers were stopped too (exit {128 + exc.sigval})",
              file=sys.stderr)
        return 128 + int(exc.sigval)
