"""Durations and rates as status lines show them; torch-free, so any command's progress can use them."""

from __future__ import annotations


def format_duration(seconds: float) -> str:
    """1:02:03 or 2:03: short enough for a status line."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_rate(tokens_per_s: float) -> str:
    """12.3k tok/s, 1.20M tok/s."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.3g}{unit} tok/s"
    return f"{tokens_per_s:.0f} tok/s"
