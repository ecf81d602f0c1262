"""What kind of failure a rank's error and output show, and the fix for each kind.

Used by `meshrun diagnose` (post-mortem), through `classify_failure` on the launcher's RankFailure,
and readable on its own: each rule is a pattern found in torch's, meshrun's or the kernel's own words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshrun.launch.failure import LEFT_EARLY_FIX

if TYPE_CHECKING:
    from meshrun.launch.failure import RankFailure


@dataclass(frozen=True)
class Kind:
    name: str
    fix: str


OOM = Kind("OOM", "the rank ran out of memory: lower train.batch_size or data.seq_len, enable "
           "train.activation_checkpointing, shard with FSDP (parallel.strategy), or check `meshrun plan`")
MISMATCH = Kind("collective mismatch", "ranks called different collectives: make every rank call the same "
                "collectives in the same order (no collective under `if rank == 0`, equal step counts per rank); "
                "the report names the diverging rank and file:line")
HANG = Kind("hang", "no rank made progress: look at the stalled rank's stack (the function named above); "
            "a rank blocked in a collective waits for that one. Rerun with --debug collectives to check order")
RDZV = Kind("rendezvous timeout", "not every node joined the rendezvous: start all nodes with the same "
            "--rdzv-endpoint/--rdzv-id, check the endpoint is reachable, or raise --rdzv-conf join_timeout")
PORT = Kind("port conflict", "the port is in use: leave --master-port/--rdzv-endpoint out on one node "
            "(meshrun picks a free port) or choose another port")
USER = Kind("exception in user code", "fix the exception at the file:line shown; other ranks only stopped "
            "because this one failed")
SIGNAL = Kind("killed by signal", "SIGKILL without a Python error is usually the kernel's OOM killer "
              "(check `dmesg`) or a scheduler's time/memory limit")
CRASH = Kind("native crash", "native code crashed (torch or a C extension): the rank's stderr has each "
             "thread's Python stack; when none is the 'Current thread', a thread with no Python frame "
             "crashed, such as gloo's, which torch 2.13 does now and then (docs/diagnose.md). Rerun, or "
             "add --max-restarts N (meshrun train resumes exactly)")
DATA = Kind("data duplication warning", "ranks read the same batches: use meshrun.prepare_dataloader, or a "
            "DistributedSampler and call sampler.set_epoch(epoch) every epoch")
LAUNCH = Kind("bad launch options", "the launcher refused the options before any worker started: follow "
              "the advice in the message above")
REFUSED = Kind("refused by meshrun", "meshrun stopped the rank with the message above, which names the key "
               "or flag, the value and the fix: change that and rerun")
LEFT = Kind("rank left early", LEFT_EARLY_FIX)  # exit code 0 while its peers still ran (launch/failure.py)
FOLLOW_ON = Kind("consequence of another rank's failure", "see the rank that failed first")

_RULES: list[tuple[Kind, re.Pattern]] = [
    (OOM, re.compile(r"OutOfMemoryError|CUDA out of memory|out of memory|MemoryError|Cannot allocate memory")),
    (MISMATCH, re.compile(r"CollectiveMismatchError|Detected mismatch between collectives|collective mismatch")),
    (HANG, re.compile(r"HangDetected|hang watchdog|Watchdog caught collective operation timeout|"
                      r"Timed out waiting .*for.*(?:collective|recv|send)|ProcessGroupGloo.*[Tt]imed out")),
    (PORT, re.compile(r"EADDRINUSE|Address already in use|address already in use")),
    (RDZV, re.compile(r"RendezvousTimeoutError|RendezvousConnectionError|rendezvous .* timed out")),
    (REFUSED, re.compile(r"^MeshrunError\b|^(?:Config|Model|Data|Launch|Env|WorldSize)Error\b")),
    (DATA, re.compile(r"meshrun: data warning")),
]
_SIGNAL_TEXT = re.compile(r"Fatal Python error: (Segmentation fault|Aborted|Bus error)|killed by (SIG\w+)")
NATIVE_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")  # the process crashed, nothing sent them


def classify(exc_type: str | None, exc_text: str | None, log_text: str, signal: str | None,
             follow_on: bool) -> Kind:
    """The kind of one rank's failure, from its exception, its output and how it ended."""
    head = " ".join(filter(None, [exc_type, exc_text]))
    for kind, pattern in _RULES:
        if kind is not DATA and pattern.search(head):
            return kind
    if follow_on:
        return FOLLOW_ON
    for kind, pattern in _RULES:
        if kind is not DATA and pattern.search(log_text[-20000:]):
            return kind
    said = _SIGNAL_TEXT.search(log_text[-20000:])
    if signal or said:
        return CRASH if signal in NATIVE_SIGNALS or (said and said.group(2) in (None, *NATIVE_SIGNALS)) else SIGNAL
    if exc_type:
        return USER
    if _RULES[-1][1].search(log_text):
        return DATA
    return USER


def classify_failure(failure: RankFailure, log_text: str = "") -> Kind:
    """The kind of one rank's failure (the launcher's RankFailure) and its stderr.

    A rank that raised is classified by its exception, even when a signal ended it afterwards
    (e.g. the agent's SIGTERM while it was still exiting).
    """
    if failure.left_early:
        return LEFT
    signal = None if failure.raised else failure.signal_name
    return classify(failure.exc_type, failure.exc_text, log_text, signal, failure.follow_on)


_LAUNCH_PORT = re.compile(r"is held by|already used by another job|bound on this host|in use|EADDRINUSE|busy")
_LAUNCH_RDZV = re.compile(r"rendezvous .*(timed out|was closed|failed)")


def classify_launch(message: str) -> Kind:
    """The kind of a failure the launcher met before any worker ran (launch_error.json)."""
    if _LAUNCH_PORT.search(message):
        return PORT
    if _LAUNCH_RDZV.search(message):
        return RDZV
    return LAUNCH
