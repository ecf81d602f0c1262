"""One status line that redraws in place in a terminal (`\\r`), for progress output.

Training progress (`meshrun.metrics.progress.ProgressBar`, stdout) and `meshrun data prepare`
(`meshrun.data.prepare_progress.PrepareProgress`, stderr) both draw through this class, so the
terminal handling lives once. Torch-free.
"""

from __future__ import annotations

import sys
from typing import TextIO


def gauge(fraction: float, width: int) -> str:
    """`[########------------]  40%` for fraction 0.4 at width 20."""
    fraction = min(1.0, max(0.0, fraction))
    filled = int(fraction * width)
    return f"[{'#' * filled}{'-' * (width - filled)}] {fraction:4.0%}"


class StatusLine:
    """The stream (looked up at call time, so tests may swap sys.stdout), whether it is a
    terminal (`is_tty` overrides `stream.isatty()`), and what is drawn on its current line."""

    default_stream = "stdout"  # or "stderr"

    def __init__(self, stream: TextIO | None = None, is_tty: bool | None = None) -> None:
        self._stream = stream
        self._is_tty = is_tty
        self._drawn = ""  # what is on the terminal's current line

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else getattr(sys, self.default_stream)

    @property
    def is_tty(self) -> bool:
        if self._is_tty is None:
            try:
                self._is_tty = self.stream.isatty()
            except (AttributeError, ValueError):
                self._is_tty = False
        return self._is_tty

    def _draw(self, text: str) -> None:
        """Redraw the line as `text`; "" wipes it and leaves the cursor at its start."""
        pad = " " * max(0, len(self._drawn) - len(text))  # wipe what a longer line left behind
        self.stream.write(f"\r{text}{pad}" + ("\r" if not text else ""))
        self.stream.flush()
        self._drawn = text

    def _println(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
