"""Rank 0's progress bar: step/total, loss, tokens/s and ETA, redrawn in a terminal, plain lines in a log.

Under `meshrun launch` stdout is a pipe (the launcher prefixes each line with [rank N]), so the
bar prints one line every `interval` steps instead of carriage-return redraws.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from meshrun.terminal import StatusLine, gauge
from meshrun.units import format_duration, format_rate

__all__ = ["ProgressBar", "format_duration", "format_rate"]


class ProgressBar(StatusLine):
    """Shows training progress on rank 0; on any other rank every call does nothing.

        bar = ProgressBar(total_steps, rank=rank)
        bar.update(step, loss=loss, tokens_per_s=tps)
        bar.write(f"eval loss {val:.4f}")   # a line that does not break the bar
        bar.close()

    `stream` defaults to sys.stdout at call time; `is_tty` overrides `stream.isatty()`; `clock`
    is injectable for tests. The ETA comes from the mean step time since the first update, which
    leaves the slow first step out.
    """

    def __init__(self, total_steps: int, *, rank: int = 0, stream: TextIO | None = None,
                 interval: int = 10, is_tty: bool | None = None, width: int = 20,
                 min_redraw_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        if total_steps <= 0:
            raise ValueError(f"total_steps must be > 0, got {total_steps}")
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.total_steps = total_steps
        self.enabled = rank == 0
        self.interval = interval
        self.width = width
        self.min_redraw_s = min_redraw_s
        super().__init__(stream, is_tty)
        self._clock = clock
        self._t0: float | None = None
        self._step0 = 0
        self._start = clock()
        self._last_draw = -float("inf")
        self._loss: float | None = None
        self._tokens_per_s: float | None = None

    def eta_s(self, step: int) -> float | None:
        """Seconds left at `step`, from the mean step time since the first update."""
        if self._t0 is None or step <= self._step0:
            return None
        per_step = (self._clock() - self._t0) / (step - self._step0)
        return per_step * max(0, self.total_steps - step)

    def format(self, step: int, *, loss: float | None = None, tokens_per_s: float | None = None,
               bar: bool = True) -> str:
        """The status text for `step`; `bar` adds the [####----] gauge."""
        fraction = min(1.0, max(0.0, step / self.total_steps))
        parts = [f"step {step}/{self.total_steps}"]
        if bar:
            parts[0] += " " + gauge(fraction, self.width)
        else:
            parts[0] += f" ({fraction:.0%})"
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if tokens_per_s is not None:
            parts.append(format_rate(tokens_per_s))
        parts.append(f"elapsed {format_duration(self._clock() - self._start)}")
        eta = self.eta_s(step)
        parts.append(f"eta {format_duration(eta) if eta is not None else '?'}")
        return " | ".join(parts)

    def update(self, step: int, *, loss: float | None = None, tokens_per_s: float | None = None) -> None:
        """Report that `step` (1-based, out of total_steps) finished.

        Call it every step; loss and tokens_per_s may come only on logging steps (the last
        values are shown until new ones arrive), so no step has to sync for `loss.item()`.
        """
        if not self.enabled:
            return
        self._loss = loss if loss is not None else self._loss
        self._tokens_per_s = tokens_per_s if tokens_per_s is not None else self._tokens_per_s
        loss, tokens_per_s = self._loss, self._tokens_per_s
        first = self._t0 is None
        if first:
            self._t0, self._step0 = self._clock(), step
        last = step >= self.total_steps
        if self.is_tty:
            now = self._clock()
            if first or last or now - self._last_draw >= self.min_redraw_s:
                self._last_draw = now
                self._draw(self.format(step, loss=loss, tokens_per_s=tokens_per_s))
        elif first or last or step % self.interval == 0:
            self._println(self.format(step, loss=loss, tokens_per_s=tokens_per_s, bar=False))

    def write(self, message: str) -> None:
        """Print a line (eval results, a warning) above the bar without garbling it."""
        if not self.enabled:
            return
        drawn = self._drawn
        if drawn:
            self._draw("")
        self._println(message)
        if drawn:
            self._draw(drawn)

    def close(self) -> None:
        """End the bar's line in a terminal. Safe to call twice."""
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = ""

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
