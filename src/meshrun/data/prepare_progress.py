"""`meshrun data prepare`'s progress on stderr: documents, tokens, their rates, share of the input
read and ETA, redrawn in place in a terminal; in a log (not a TTY) only the final line.

    progress = PrepareProgress(workers=4)
    progress.start(total_bytes)                      # prepare_tokens calls these three
    progress.update(done_bytes, documents, tokens)   # after each batch; cheap, throttled
    progress.close()                                 # the final line, in both modes

The share and ETA come from the bytes of input read, the one total known before reading
(a .jsonl's record count is not).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from meshrun.terminal import StatusLine, gauge
from meshrun.units import format_duration, format_rate


def _count(n: float) -> str:
    """1234 -> 1,234; 1.5e6 -> 1.50M."""
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{int(n):,}"


class PrepareProgress(StatusLine):
    default_stream = "stderr"

    def __init__(self, total_bytes: int = 0, *, workers: int = 1, stream: TextIO | None = None,
                 is_tty: bool | None = None, width: int = 20, min_redraw_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_bytes = total_bytes
        self.workers = workers
        self.width = width
        self.min_redraw_s = min_redraw_s
        super().__init__(stream, is_tty)
        self._clock = clock
        self._start = clock()
        self._last_draw = -float("inf")
        self.done_bytes = self.documents = self.tokens = 0
        self.closed = False

    def start(self, total_bytes: int) -> None:
        """Begin timing, with the input's total size (0 = unknown: no gauge, no ETA)."""
        self.total_bytes = total_bytes
        self._start = self._clock()

    def _rates(self) -> tuple[float, float, float]:
        elapsed = max(1e-9, self._clock() - self._start)
        return elapsed, self.documents / elapsed, self.tokens / elapsed

    def format(self) -> str:
        """The status line: counts, rates, a gauge of the input read, elapsed and ETA."""
        elapsed, docs_per_s, tokens_per_s = self._rates()
        parts = [f"{_count(self.documents)} docs", f"{_count(self.tokens)} tokens",
                 format_rate(tokens_per_s), f"{docs_per_s:,.0f} docs/s"]
        eta = "?"
        if self.total_bytes > 0:
            parts.append(gauge(self.done_bytes / self.total_bytes, self.width))
            if self.done_bytes:
                eta = format_duration(elapsed * (self.total_bytes - self.done_bytes) / self.done_bytes)
        parts.append(f"elapsed {format_duration(elapsed)} | eta {eta}")
        return " | ".join(parts)

    def update(self, done_bytes: int, documents: int, tokens: int) -> None:
        """Totals so far (not increments); redrawn at most every min_redraw_s, only in a terminal."""
        self.done_bytes, self.documents, self.tokens = done_bytes, documents, tokens
        now = self._clock()
        if self.is_tty and now - self._last_draw >= self.min_redraw_s:
            self._last_draw = now
            self._draw(self.format())

    def summary(self) -> str:
        elapsed, docs_per_s, tokens_per_s = self._rates()
        workers = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        return (f"tokenized {self.documents:,} documents, {self.tokens:,} tokens in {format_duration(elapsed)} "
                f"({format_rate(tokens_per_s)}, {docs_per_s:,.0f} docs/s, {workers})")

    def close(self, *, summary: bool = True) -> None:
        """Replace the bar with the final line (also printed when not a TTY), or only wipe it
        (summary=False: an error follows). Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self._drawn:
            self.stream.write("\r" + " " * len(self._drawn) + "\r")
        if summary:
            self.stream.write(self.summary() + "\n")
        self.stream.flush()
