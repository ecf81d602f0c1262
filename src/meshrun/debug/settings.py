"""The debug settings a worker reads from its environment, and the one timeout hierarchy.

    --hang-timeout H   (MESHRUN_HANG_TIMEOUT, default 300 s, 0 = watchdog off)
      watchdog      H      no rank made progress for H seconds: dump stacks, fail the job
      collective    2H     torch's own collective timeout (init_process_group(timeout=)),
                           so the watchdog, which says where every rank is, always fires first
      init          2H     the same value: init_process_group uses it for its store too
      rendezvous    max(600, 2H)  torchrun's --rdzv-conf join_timeout, never shorter than init

With the watchdog off the collective and init timeouts stay torch's (30 min on gloo).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from meshrun.debug.readable import VERBOSE_ENV
from meshrun.errors import LaunchError

HANG_TIMEOUT_ENV = "MESHRUN_HANG_TIMEOUT"
DEBUG_ENV = "MESHRUN_DEBUG"
HANG_TIMEOUT_SET_ENV = "MESHRUN_HANG_TIMEOUT_SET"  # "1": the user chose it (then conflicts are refused)
DEFAULT_HANG_TIMEOUT_S = 300.0
MIN_HANG_TIMEOUT_S = 5.0
DEBUG_MODES = ("collectives",)
RDZV_JOIN_DEFAULT_S = 600.0  # torch c10d rendezvous join_timeout default


@dataclass(frozen=True)
class TimeoutPlan:
    """Every timeout of a job, derived from --hang-timeout (see the module docstring)."""

    watchdog_s: float  # 0 = off
    collective_s: float | None  # None = torch's default
    init_s: float | None
    rendezvous_s: float

    @classmethod
    def from_hang_timeout(cls, hang_s: float) -> TimeoutPlan:
        if hang_s <= 0:
            return cls(0.0, None, None, RDZV_JOIN_DEFAULT_S)
        return cls(hang_s, 2 * hang_s, 2 * hang_s, max(RDZV_JOIN_DEFAULT_S, 2 * hang_s))


def parse_hang_timeout(value: str | float | None, *, source: str = "--hang-timeout") -> float:
    """Seconds, 0 = off; anything else below MIN_HANG_TIMEOUT_S is refused with one line."""
    if value is None or str(value).strip() == "":
        return DEFAULT_HANG_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise LaunchError(f"{source} {value!r}: expected seconds, e.g. {source} 300 (0 turns the watchdog off)") from None
    if not math.isfinite(seconds) or seconds < 0 or 0 < seconds < MIN_HANG_TIMEOUT_S:
        raise LaunchError(f"{source} {value}: must be 0 (off) or a finite number >= {MIN_HANG_TIMEOUT_S:g} seconds, e.g. {source} 60")
    return seconds


def parse_debug(value: str | None, *, source: str = "--debug") -> frozenset[str]:
    modes = frozenset(m.strip() for m in (value or "").split(",") if m.strip())
    unknown = sorted(modes - set(DEBUG_MODES))
    if unknown:
        raise LaunchError(f"{source} {value!r}: unknown mode {unknown[0]!r}; choose from {', '.join(DEBUG_MODES)}")
    return modes


def check_collective_timeout(collective_s: float | None, hang_s: float) -> None:
    """A collective timeout at or below a chosen watchdog's would fire first, with no stacks: refuse it.

    (With the default --hang-timeout, the watchdog shortens itself to half the timeout instead.)
    """
    if collective_s is not None and hang_s > 0 and collective_s <= hang_s:
        raise LaunchError(
            f"collective timeout {collective_s:g}s is not above --hang-timeout {hang_s:g}s, so torch would time "
            f"out first and no rank's stack would be shown; use a timeout > {hang_s:g}s or a lower --hang-timeout"
        )


def check_rendezvous_timeout(rdzv_conf: str | None, hang_s: float) -> None:
    """--rdzv-conf join_timeout below the init timeout would give up on ranks still starting."""
    plan = TimeoutPlan.from_hang_timeout(hang_s)
    for item in (rdzv_conf or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "join_timeout" and value.strip():
            try:
                join = float(value)
            except ValueError:
                raise LaunchError(f"--rdzv-conf join_timeout={value!r}: expected seconds, e.g. join_timeout=900") from None
            if plan.init_s is not None and join < plan.init_s:
                raise LaunchError(
                    f"--rdzv-conf join_timeout={value} is below the init timeout {plan.init_s:g}s "
                    f"(2 x --hang-timeout {hang_s:g}); raise join_timeout to >= {plan.init_s:g} or lower --hang-timeout"
                )


@dataclass(frozen=True)
class DebugSettings:
    """What a worker was asked to do, read once from its environment."""

    hang_timeout_s: float
    modes: frozenset[str]
    explicit: bool = False  # --hang-timeout was given, not the default

    @property
    def collectives(self) -> bool:
        return "collectives" in self.modes

    @property
    def plan(self) -> TimeoutPlan:
        return TimeoutPlan.from_hang_timeout(self.hang_timeout_s)

    @classmethod
    def from_env(cls, environ=None) -> DebugSettings:
        environ = os.environ if environ is None else environ
        raw = environ.get(HANG_TIMEOUT_ENV)
        if raw is None or "TORCHELASTIC_RUN_ID" not in environ:  # not a `meshrun launch` worker
            hang = 0.0
        else:
            hang = parse_hang_timeout(raw, source=HANG_TIMEOUT_ENV)
        return cls(hang, parse_debug(environ.get(DEBUG_ENV), source=DEBUG_ENV),
                   explicit=environ.get(HANG_TIMEOUT_SET_ENV) == "1")


def worker_env(hang_timeout_s: float, debug: str | None, environ=None, *, explicit: bool = False,
               verbose: bool = False) -> dict[str, str]:
    """The variables `meshrun launch` sets for its workers."""
    environ = os.environ if environ is None else environ
    env = {HANG_TIMEOUT_ENV: f"{hang_timeout_s:g}", HANG_TIMEOUT_SET_ENV: "1" if explicit else "0"}
    if verbose:  # every frame, C++ and meshrun's own included (debug/readable.py)
        env[VERBOSE_ENV] = "1"
    modes = parse_debug(debug)
    if modes:
        # Not TORCH_DISTRIBUTED_DEBUG=DETAIL as well: on torch 2.13 (CPU, gloo) it makes DDP's
        # constructor segfault (set_construction_data_and_log); users may still set it themselves.
        env[DEBUG_ENV] = ",".join(sorted(modes))
    return env


def apply_launch_args(args) -> dict[str, str]:
    """Check a parsed `meshrun launch` namespace's timeouts; return the env for its workers.

    Also lengthens the rendezvous join timeout when 2 x --hang-timeout exceeds torch's c10d default of 600 s.
    """
    given = getattr(args, "hang_timeout", None)
    explicit = given is not None or HANG_TIMEOUT_ENV in os.environ
    hang = parse_hang_timeout(given if given is not None else os.environ.get(HANG_TIMEOUT_ENV))
    conf = getattr(args, "rdzv_conf", "") or ""
    check_rendezvous_timeout(conf, hang)
    plan = TimeoutPlan.from_hang_timeout(hang)
    if plan.rendezvous_s > RDZV_JOIN_DEFAULT_S and "join_timeout" not in conf:
        args.rdzv_conf = ",".join(filter(None, [conf, f"join_timeout={plan.rendezvous_s:g}"]))
    return worker_env(hang, getattr(args, "debug", None), explicit=explicit,
                      verbose=bool(getattr(args, "verbose", False)))
