"""The one place meshrun touches torch's elastic launcher (torch.distributed.run, .launcher, .elastic).

Everything meshrun needs from torchrun's machinery goes through here: its argument parser, its
`config_from_args`, `elastic_launch`, its error types, the agent's logger and the log directory
of the current run. When a torch release moves one of these, this file is the one to change.

torch 2.13's `LaunchConfig` has no field for the workers' environment: the agent builds it from
`os.environ` when it starts the workers (and reads launcher settings such as
TORCH_DISABLE_SHARE_RDZV_TCP_STORE from there too). `run_agent` therefore sets the plan's
variables only while the agent runs and restores the caller's environment afterwards.

The store this agent hosts (c10d's on node 0, or static's on node rank 0) listens only on the
endpoint host's address: `agent_store` serves it there first (runtime/store.py), and torch's own
multi-tenant TCPStore on that port reuses it. Without that, torch binds every interface.
Imported only once a launch is about to run: it imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

if TYPE_CHECKING:
    from meshrun.launch.failure import WorkerExit

__all__ = [
    "AGENT_PROCS_LOGGER", "ChildFailedError", "JOIN_TIMEOUT_DEFAULT_S", "LaunchConfig", "RendezvousClosedError",
    "RendezvousError", "RendezvousTimeoutError", "SignalException", "agent_environ", "agent_failure_record", "build_config",
    "agent_store", "run_agent", "run_log_dir", "scoped_environ", "torchrun_parser",
]

# The agent's logger for worker processes; it logs one ERROR record per failed attempt:
# "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s".
AGENT_PROCS_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_AGENT_FAILURE_PREFIX = "failed (exitcode"
_CHATTY_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run")
JOIN_TIMEOUT_DEFAULT_S = 600  # c10d rendezvous' join_timeout when --rdzv-conf does not set one


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own argument parser (every flag, torch's spellings and defaults)."""
    return get_args_parser()


def build_config(options: argparse.Namespace, environ: Mapping[str, str]):
    """(LaunchConfig, entrypoint, entrypoint args) from torchrun's options, as torchrun builds them.

    `environ` holds the variables the job will run with: torch reads OMP_NUM_THREADS and the log
    prefix template from the environment here, and would set OMP_NUM_THREADS in this process.
    """
    with scoped_environ(environ):
        return config_from_args(options)


def run_agent(config: LaunchConfig, entrypoint, args: list[str], environ: Mapping[str, str],
              *, quiet: bool = True, exits: MutableMapping[int, WorkerExit] | None = None) -> None:
    """Run the elastic agent to the end, with `environ` set for it and its workers only meanwhile.

    quiet: torchelastic's INFO/WARNING chatter buries the user's output; errors still show.
    exits: filled with the latest attempt's workers' ends, by local rank (see `_exits_recorded`).
    """
    with scoped_environ(environ), _quiet_loggers(quiet), _plain_failure_records(), agent_store(config), \
            _tolerant_error_files(), _quiet_master_port(config), _leftovers_ended(), \
            _exits_recorded({} if exits is None else exits):
        elastic_launch(config=config, entrypoint=entrypoint)(*args)


def agent_environ(config: LaunchConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables os.environ holds while the agent runs: `environ` (run_agent's), and what
    `elastic_launch` sets itself before it starts the agent (torch 2.13: the signals to handle)."""
    signals = getattr(config, "signals_to_handle", None)
    return {**environ, **({"TORCHELASTIC_SIGNALS_TO_HANDLE": signals} if signals else {})}


@contextlib.contextmanager
def _quiet_master_port(config: LaunchConfig) -> Iterator[None]:
    """On one node, rank 0's MASTER_PORT (a new one each attempt) comes from below the ephemeral range.

    torch 2.13's c10d rendezvous picks it with `get_free_port()` (bind to 0, close) and rank 0
    binds it seconds later, once its worker has started: meanwhile any outgoing connection on the
    machine may be handed that port as its local end, and rank 0 dies with EADDRINUSE. A port from
    `quiet_port` (launch/ports.py) is one the OS never hands out by itself. Several nodes keep
    torch's choice: firewalls between nodes are opened for the ephemeral range (docs/multinode.md).
    """
    if config.max_nodes != 1:
        yield
        return
    from torch.distributed.elastic.rendezvous import api as rdzv_api

    from meshrun.launch.ports import quiet_port

    original = rdzv_api.get_free_port
    rdzv_api.get_free_port = quiet_port
    try:
        yield
    finally:
        rdzv_api.get_free_port = original


class _NoTraceback(logging.Filter):
    """The agent's per-attempt failure record without torch's own traceback.

    For a Python-callable entrypoint (meshrun train's forked workers) torch logs it with
    `logger.exception`: a traceback of its ProcessExitedException, which says nothing the record,
    the attempt notice and the failure summary do not say better. One line, as for exec'd workers.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(_AGENT_FAILURE_PREFIX):
            record.exc_info, record.exc_text = None, None
        return True


@contextlib.contextmanager
def _plain_failure_records() -> Iterator[None]:
    logger, plain = logging.getLogger(AGENT_PROCS_LOGGER), _NoTraceback()
    logger.addFilter(plain)
    try:
        yield
    finally:
        logger.removeFilter(plain)


@contextlib.contextmanager
def _tolerant_error_files() -> Iterator[None]:
    """While the agent runs, a rank's empty or partial error file reads as no error file.

    torch 2.13's ProcessFailure parses each failed rank's error.json in the agent and re-raises
    any parse error, so a file a full disk left empty (JSONDecodeError) crashed the launcher
    before any summary. The file's path is kept: the summary still finds the rank's logs there.
    """
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    original = ProcessFailure.__post_init__

    def post_init(self) -> None:  # noqa: ANN001 - dataclass hook
        if _error_file_readable(self.error_file):
            original(self)
            return
        path, self.error_file = self.error_file, ""  # torch's own "no error file" path
        original(self)
        self.error_file = path

    ProcessFailure.__post_init__ = post_init
    try:
        yield
    finally:
        ProcessFailure.__post_init__ = original


@contextlib.contextmanager
def _leftovers_ended() -> Iterator[None]:
    """While the agent runs, closing an attempt's workers also ends what they started (leftovers.py).

    torch's `PContext` starts and closes each attempt's workers, on success, failure, restart and
    stop alike; the workers' pids are read when they start, and what is left in their sessions
    is stopped once torch has closed them.
    """
    from torch.distributed.elastic.multiprocessing.api import PContext

    from meshrun.launch.leftovers import end_sessions

    start, close = PContext.start, PContext.close

    def started(self) -> None:  # noqa: ANN001 - torch's signature
        start(self)
        with contextlib.suppress(Exception):  # a context that failed to start has no pids
            self._meshrun_workers = dict(self.pids())

    def closed(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003 - torch's signature
        for pid in getattr(self, "_meshrun_workers", {}).values():  # a stopped worker (SIGSTOP, a frozen
            with contextlib.suppress(OSError):  # host) acts on torch's SIGTERM only once continued
                os.kill(pid, signal.SIGCONT)
        try:
            close(self, *args, **kwargs)
        finally:
            end_sessions(getattr(self, "_meshrun_workers", {}))

    PContext.start, PContext.close = started, closed
    try:
        yield
    finally:
        PContext.start, PContext.close = start, close


@contextlib.contextmanager
def _exits_recorded(exits: MutableMapping[int, WorkerExit]) -> Iterator[None]:
    """While the agent runs, `exits` holds when each worker of the latest attempt ended, and how.

    torch's failure record (ProcessFailure) lists only workers that exited nonzero, stamped in
    whole seconds: a worker that exited 0 while its peers still ran is not in it, yet its peers'
    'Connection closed by peer' is its doing (launch/failure.py name_first_to_leave). The agent
    polls its workers every monitor interval through `PContext.wait`; each poll is noted around
    it. A worker seen gone after the poll that ended the group was stopped by the agent (not
    `running`), unless torch counted it done before stopping the others.
    """
    from torch.distributed.elastic.multiprocessing.api import PContext

    from meshrun.launch.failure import WorkerExit

    start, wait = PContext.start, PContext.wait

    def note(pcontext, running: bool) -> None:
        now = time.time()
        pids = getattr(pcontext, "_meshrun_exit_pids", {})
        still = getattr(pcontext, "_running_local_ranks", None)  # SubprocessContext's: not done when it stopped
        done_before_stop = set(range(pcontext.nprocs)) - set(still) if still is not None else set()
        for local_rank, code in _exit_codes(pcontext).items():
            if local_rank in exits or code is None:
                continue
            env = pcontext.envs.get(local_rank, {}) if isinstance(pcontext.envs, dict) else {}
            rank = int(env["RANK"]) if str(env.get("RANK", "")).isdigit() else -1
            exits[local_rank] = WorkerExit(local_rank, rank, pids.get(local_rank, 0), code, now,
                                           running or local_rank in done_before_stop)

    def started(self) -> None:  # noqa: ANN001 - torch's signature
        exits.clear()  # a new attempt
        start(self)
        with contextlib.suppress(Exception):
            self._meshrun_exit_pids = dict(self.pids())

    def waited(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - torch's signature
        with contextlib.suppress(Exception):  # a record must never take the agent down
            note(self, running=True)
        result = wait(self, *args, **kwargs)
        with contextlib.suppress(Exception):
            note(self, running=result is None)
        return result

    PContext.start, PContext.wait = started, waited
    try:
        yield
    finally:
        PContext.start, PContext.wait = start, wait


def _exit_codes(pcontext) -> dict[int, int | None]:
    """Each worker's exit code (negative: its signal), None while it runs; {} for an unknown context.

    Popen.poll and multiprocessing's exitcode keep the status they read: torch reads the same one after.
    """
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if handlers:  # SubprocessContext: exec'd workers
        return {local_rank: handler.proc.poll() for local_rank, handler in handlers.items()}
    context = getattr(pcontext, "_pc", None)  # MultiprocessContext: forked workers (meshrun train's)
    processes = getattr(context, "processes", None) or []
    return {local_rank: process.exitcode for local_rank, process in enumerate(processes)}


def _error_file_readable(path: str) -> bool:
    """Is `path` missing (torch handles that) or an error file torch can parse? False for a damaged one."""
    import json

    if not path or not os.path.isfile(path):
        return True
    try:
        with open(path) as fp:
            data = json.load(fp)
        message = data["message"]
        int(data.get("timestamp", 0) if isinstance(message, str) else message["extraInfo"]["timestamp"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


_FALSE = ("0", "false", "f", "no", "n")  # torch's RendezvousParameters.get_as_bool


@contextlib.contextmanager
def agent_store(config: LaunchConfig) -> Iterator[None]:
    """While the agent runs, serve the store it hosts on the endpoint host's address only.

    c10d at port 0 (a single node) gets the free port chosen here written into
    `config.rdzv_endpoint`. A node that must not host (static node rank > 0, c10d is_host=0),
    another agent already on the port, or an endpoint that is not this machine's: torch decides.
    """
    from meshrun.launch.preflight import parse_endpoint
    from meshrun.runtime.store import hold_server

    conf = config.rdzv_configs or {}
    if config.rdzv_backend == "static":
        hosts = str(conf.get("rank", 0)) == "0"
    elif config.rdzv_backend == "c10d" and conf.get("store_type", "tcp") == "tcp":
        hosts = str(conf.get("is_host", "")).strip().lower() not in _FALSE
    else:
        hosts = False
    if not hosts:
        yield
        return
    host, port = parse_endpoint(config.rdzv_endpoint)
    with hold_server(host, port, one_node=config.max_nodes == 1) as store:
        if store is not None and port == 0:
            config.rdzv_endpoint = f"[{host}]:{store.port}" if ":" in host else f"{host}:{store.port}"
        yield


def run_log_dir(logs_specs) -> str | None:
    """This agent's own `<log_dir>/<run_id>_XXXX` (torch keeps it private; None when unknown)."""
    return getattr(logs_specs, "_run_log_dir", None)


def agent_failure_record(record: logging.LogRecord) -> tuple[int, int, int] | None:
    """(exitcode, local_rank, pid) of the agent's per-attempt failure record, else None."""
    if not str(record.msg).startswith(_AGENT_FAILURE_PREFIX) or not isinstance(record.args, tuple):
        return None
    try:
        exitcode, local_rank, pid = (int(a) for a in record.args[:3])
    except (TypeError, ValueError):
        return None
    return exitcode, local_rank, pid


@contextlib.contextmanager
def scoped_environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Set `updates` in os.environ for the duration of the block, then restore every key as it was."""
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet_loggers(quiet: bool) -> Iterator[None]:
    """torchelastic's loggers at ERROR while the agent runs. Each of its modules' loggers sets its
    own level (torch's get_logger reads $LOGLEVEL), so the children are set too, not only the parents."""
    names = [name for name in list(logging.root.manager.loggerDict)
             if any(name == top or name.startswith(top + ".") for top in _CHATTY_LOGGERS)]
    loggers = [logging.getLogger(name) for name in {*_CHATTY_LOGGERS, *names}] if quiet else []
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)  # ERROR, not above: launch/attempts.py records failed attempts from them
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
