"""`meshrun launch [torchrun options] script.py [args]`: see `meshrun launch --help`."""

from __future__ import annotations

from meshrun.launch.args import build_parser
from meshrun.launch.launcher import run_launch


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return run_launch(args)
