"""Turn what the ranks sent (or failed to send) into the error `run_distributed` raises."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from dataclasses import dataclass
from typing import Any

from meshrun.testing.errors import DistributedTestError, DistributedTimeoutError, RankExitedError
from meshrun.testing.worker import STACK_DUMP_SIGNAL, run_rank

# How long hung ranks get to write their stacks after STACK_DUMP_SIGNAL.
STACK_DUMP_WAIT_S = 0.5

# What a peer sees when another rank dies mid-collective: a consequence, never the cause.
_FOLLOW_ON_MARKERS = (
    "connection reset by peer",
    "connection closed by peer",
    "connection refused",
    "broken pipe",
    "socket closed",
)


@dataclass
class Failure:
    """One rank's failure: when it happened, and whether it only reacts to another rank's."""

    rank: int
    time: float
    error: DistributedTestError
    follow_on: bool = False


@dataclass
class Unfinished:
    """A rank still running at the timeout."""

    rank: int
    state: str
    pid: int | None
    stack_path: str | None  # None: its stacks cannot be dumped (not armed yet)


def error_failure(rank: int, info: dict[str, Any]) -> Failure:
    """The failure for a rank that sent ``("error", info)`` (see worker.run_rank)."""
    exception = None
    if info["exception"] is not None:
        with contextlib.suppress(Exception):  # the type may not import here; the text remains
            exception = pickle.loads(info["exception"])
    remote_tb = info["traceback"].rstrip()
    what = f"{info['type']}: {info['message']}" if info["message"] else info["type"]
    error = DistributedTestError(
        f"rank {rank} failed: {what}\n\n--- rank {rank} traceback ---\n{remote_tb}",
        rank=rank,
        exc_type=info["type"],
        remote_traceback=remote_tb,
        exception=exception,
    )
    text = info["message"].lower()
    follow_on = any(marker in text for marker in _FOLLOW_ON_MARKERS)
    return Failure(rank, info["time"], error, follow_on)


def exit_failure(rank: int, exitcode: int, *, returned: bool) -> Failure:
    """The failure for a rank that ended without sending an error."""
    name = None
    if exitcode < 0:
        name = _signal_name(-exitcode)
        how = f"was killed by signal {name} (exit code {exitcode})"
    else:
        how = f"exited with code {exitcode} without raising an exception"
    when = " after fn returned (at shutdown or interpreter exit)" if returned else ""
    error = RankExitedError(
        f"rank {rank} failed: {how}{when}; see the rank's stderr",
        rank=rank,
        exitcode=exitcode,
        signal_name=name,
    )
    return Failure(rank, time.time(), error)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def first_failure(failures: list[Failure]) -> DistributedTestError:
    """The earliest failure that is not a peer's reaction to it; the rest are listed after it."""
    ordered = sorted(failures, key=lambda f: (f.follow_on, f.time))
    first = ordered[0].error
    if len(ordered) > 1:
        others = "\n".join(f"  {str(f.error).splitlines()[0]}" for f in ordered[1:])
        first.args = (f"{first.args[0]}\n\n--- later failures on other ranks ---\n{others}",)
    return first


def timeout_error(unfinished: list[Unfinished], timeout: float) -> DistributedTimeoutError:
    """Dump the unfinished ranks' stacks (they are still alive) and describe where each was."""
    stacks = _dump_stacks(unfinished)
    ranks = [u.rank for u in unfinished]
    lines = "".join(f"\n  rank {u.rank}: {u.state}" for u in unfinished)
    message = (
        f"run_distributed timed out after {timeout:g}s; ranks {ranks} had not finished "
        f"(all ranks were killed):{lines}"
    )
    for rank, text in stacks.items():
        message += f"\n\n--- rank {rank} Python stack at the timeout ---\n{text}"
    return DistributedTimeoutError(message, timeout=timeout, ranks=ranks, stacks=stacks)


def _dump_stacks(unfinished: list[Unfinished]) -> dict[int, str]:
    armed = [u for u in unfinished if u.pid is not None and u.stack_path is not None]
    if STACK_DUMP_SIGNAL is None or not armed:
        return {}
    for u in armed:
        with contextlib.suppress(OSError):
            os.kill(u.pid, STACK_DUMP_SIGNAL)  # by pid; faulthandler writes even while blocked in C
    time.sleep(STACK_DUMP_WAIT_S)
    stacks: dict[int, str] = {}
    for u in armed:
        with contextlib.suppress(OSError), open(u.stack_path) as fp:
            stacks[u.rank] = _trim_stack(fp.read())
    return {rank: text for rank, text in stacks.items() if text}


def _trim_stack(text: str) -> str:
    """Drop the harness and multiprocessing frames under run_rank from a faulthandler dump."""
    harness_frame = f'File "{run_rank.__code__.co_filename}"'
    lines: list[str] = []
    skipping = False
    for line in text.strip().splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            skipping = False
        elif skipping:
            continue
        elif harness_frame in line and line.endswith(" in run_rank"):
            skipping = True
            continue
        lines.append(line)
    return "\n".join(lines).strip()
