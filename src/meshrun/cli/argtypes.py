"""argparse `type=` functions shared by the subcommands: each raises ArgumentTypeError, which
argparse turns into one `meshrun X: error: argument --flag: ...` line and exit 2."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
