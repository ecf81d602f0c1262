"""Every `meshrun launch` / `meshrun train` launch option checked before torch is imported.

`check_launch_options(options)` looks at the parsed torchrun namespace (after SLURM filled it in)
and raises one LaunchError line naming the flag, the value and the fix: ranges (ports 1-65535,
finite timeouts), formats (--tee, --rdzv-conf, --signals-to-handle), feasibility (--log-dir
creatable, rendezvous hosts resolvable within seconds, a held static port, several nodes with no
endpoint), and the machine's shared memory (the agent's worker queues need a POSIX semaphore in
/dev/shm: a full one fails inside torch with a traceback). No directory is created; the only
network use is a bounded name lookup and a bind().
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import socket
import threading
from collections.abc import Mapping

from meshrun.debug.settings import HANG_TIMEOUT_ENV
from meshrun.errors import LaunchError
from meshrun.launch.args import MAX_NPROC_PER_NODE, check_nproc_per_node, parse_nnodes
from meshrun.writable import check_creatable_dir

BACKENDS = ("static", "c10d", "etcd", "etcd-v2")  # torch's built-in rendezvous handlers
EVENT_LOG_HANDLERS = ("console", "dynamic_rendezvous", "null")
MAX_SECONDS = 7 * 24 * 3600.0  # one week: longer timeouts overflow torch's timedelta/ms arithmetic
MAX_RESTARTS = 1_000_000
RESOLVE_DEADLINE_S = 3.0
_STREAMS = re.compile(r"^[0-3]$|^\d+:[0-3](,\d+:[0-3])*$")
_RDZV_TIMEOUTS = ("join_timeout", "last_call_timeout", "close_timeout", "read_timeout", "timeout")


def finite_seconds(value: object, flag: str, *, zero_ok: bool = True, example: str = "60") -> float:
    """A number of seconds in [0, one week] (or (0, ...] when zero_ok=False), else one line."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise LaunchError(f"{flag} {value!r}: expected seconds, e.g. {flag} {example}") from None
    low_ok = seconds >= 0 if zero_ok else seconds > 0
    if not math.isfinite(seconds) or not low_ok or seconds > MAX_SECONDS:
        low = ">= 0" if zero_ok else "> 0"
        raise LaunchError(f"{flag} {value}: must be a finite number of seconds {low} and <= {MAX_SECONDS:g} "
                          f"(one week), e.g. {flag} {example}")
    return seconds


def check_port(port: object, flag: str, *, zero_ok: bool = False) -> int:
    low = 0 if zero_ok else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise LaunchError(f"{flag} {port}: a TCP port is {low}-65535; e.g. {flag} 29500, or leave it out "
                          f"and meshrun picks a free one")
    return port


def check_launch_options(options: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Raise one LaunchError line for the first option that cannot work (see the module doc)."""
    check_nproc_per_node(str(options.nproc_per_node))
    low, high = parse_nnodes(options.nnodes)
    _check_rendezvous_flags(options, high)
    _check_counts(options, high)
    _check_formats(options)
    if options.log_dir:
        check_creatable_dir(options.log_dir, "--log-dir", error=LaunchError,
                            fix="give a directory you can write, or leave --log-dir out")
    hang = getattr(options, "hang_timeout", None)
    if hang is not None:
        finite_seconds(hang, "--hang-timeout", example="300 (0 turns the watchdog off)")
    elif (environ or {}).get(HANG_TIMEOUT_ENV, "").strip():
        finite_seconds(environ[HANG_TIMEOUT_ENV], f"${HANG_TIMEOUT_ENV}", example="300")
    _check_endpoint_reachable(options, high)
    check_shared_memory()


def check_shared_memory() -> None:
    """A semaphore can be made (and is released at once), as torch's agent makes one per worker queue."""
    import errno
    import multiprocessing

    try:
        multiprocessing.get_context("fork").Lock()  # fork's is unlinked at once: no resource tracker
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EACCES, errno.EROFS):
            raise
        try:
            info = os.statvfs("/dev/shm")
            free = f" ({info.f_bavail * info.f_frsize // 1024} KiB free of {info.f_blocks * info.f_frsize // 1024} KiB)"
        except OSError:
            free = ""
        raise LaunchError(f"/dev/shm cannot hold a semaphore{free}: {exc.strerror}; the workers' queues need "
                          "one each: free space there (df -h /dev/shm; ls -la /dev/shm), or give the container "
                          "more (docker run --shm-size=8g, or --ipc=host)") from None


def _check_rendezvous_flags(options: argparse.Namespace, max_nodes: int) -> None:
    from meshrun.launch.preflight import parse_endpoint

    backend = options.rdzv_backend
    if backend not in BACKENDS and backend not in _plugin_backends():
        raise LaunchError(f"--rdzv-backend {backend!r} is not a rendezvous backend; use c10d "
                          f"(or {', '.join(repr(b) for b in BACKENDS if b != 'c10d')})")
    if options.rdzv_endpoint:
        parse_endpoint(options.rdzv_endpoint)  # host and port, each one line when malformed
    if options.master_port is not None:
        check_port(options.master_port, "--master-port")
    for item in filter(None, (s.strip() for s in (options.rdzv_conf or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise LaunchError(f"--rdzv-conf {options.rdzv_conf!r}: {item!r} is not KEY=VALUE; "
                              f"e.g. --rdzv-conf join_timeout=600,read_timeout=60")
        if key.strip() in _RDZV_TIMEOUTS:
            finite_seconds(value, f"--rdzv-conf {key.strip()}=", zero_ok=False, example="600")
    if max_nodes > 1 and not options.standalone and not _has_endpoint(options):
        raise LaunchError(
            f"--nnodes {options.nnodes} needs a rendezvous every node can reach: add "
            f"--rdzv-backend c10d --rdzv-endpoint NODE0_HOST:29400 (the same on every node; "
            f"under SLURM meshrun fills it in), or --nnodes 1 for one machine")


def _has_endpoint(options: argparse.Namespace) -> bool:
    if options.rdzv_endpoint:
        return True
    # static: --master-addr names node 0; the default 127.0.0.1 can be reached from no other node
    return options.rdzv_backend == "static" and options.master_addr not in ("127.0.0.1", "localhost", "")


def _plugin_backends() -> set[str]:
    """Rendezvous backends other packages register (torchrun's entry point group), unloaded."""
    from importlib.metadata import entry_points

    try:
        return {ep.name for ep in entry_points(group="torchrun.handlers")}
    except Exception:  # noqa: BLE001 - a broken distribution's metadata: only built-ins then
        return set()


def _check_counts(options: argparse.Namespace, max_nodes: int) -> None:
    if not 0 <= options.max_restarts <= MAX_RESTARTS:
        raise LaunchError(f"--max-restarts {options.max_restarts}: must be 0-{MAX_RESTARTS}, e.g. --max-restarts 3")
    if not 0 <= options.node_rank < max(max_nodes, 1):
        raise LaunchError(f"--node-rank {options.node_rank}: must be 0-{max_nodes - 1} for --nnodes "
                          f"{options.nnodes} (node 0 hosts the rendezvous)")
    finite_seconds(options.monitor_interval, "--monitor-interval", zero_ok=False, example="0.1")
    if options.shutdown_timeout is not None:
        finite_seconds(options.shutdown_timeout, "--shutdown-timeout", example="30")
    if options.event_log_handler not in EVENT_LOG_HANDLERS:
        raise LaunchError(f"--event-log-handler {options.event_log_handler!r}: choose one of "
                          f"{', '.join(EVENT_LOG_HANDLERS)}")


def _check_formats(options: argparse.Namespace) -> None:
    for flag, value in (("--redirects", options.redirects), ("--tee", options.tee)):
        if not _STREAMS.match(str(value).strip()):
            raise LaunchError(f"{flag} {value!r}: expected 0-3 (1 = stdout, 2 = stderr, 3 = both) or "
                              f"LOCAL_RANK:N pairs, e.g. {flag} 3 or {flag} 0:3,1:2")
    ranks = [r.strip() for r in (options.local_ranks_filter or "").split(",") if r.strip()]
    if not all(r.isdigit() and int(r) < MAX_NPROC_PER_NODE for r in ranks):
        raise LaunchError(f"--local-ranks-filter {options.local_ranks_filter!r}: expected local ranks "
                          f"separated by commas, e.g. --local-ranks-filter 0,1")
    for name in filter(None, (s.strip() for s in (options.signals_to_handle or "").split(","))):
        if not isinstance(getattr(signal, name, None), signal.Signals):
            raise LaunchError(f"--signals-to-handle {options.signals_to_handle!r}: {name!r} is not a "
                              f"signal name; e.g. --signals-to-handle SIGTERM,SIGINT,SIGUSR1")
    if options.logs_specs is not None and options.logs_specs not in _logs_specs():
        raise LaunchError(f"--logs-specs {options.logs_specs!r}: no `torchrun.logs_specs` entry point of "
                          f"that name is installed; leave it out for torch's default")
    for flag, value in (("--master-addr", options.master_addr), ("--local-addr", options.local_addr),
                        ("--rdzv-id", options.rdzv_id), ("--role", options.role)):
        if value is not None and ("\x00" in str(value) or any(c.isspace() for c in str(value))):
            raise LaunchError(f"{flag} {value!r}: must not contain spaces or NUL bytes")


def _logs_specs() -> set[str]:
    from importlib.metadata import entry_points

    try:
        return {ep.name for ep in entry_points(group="torchrun.logs_specs")}
    except Exception:  # noqa: BLE001
        return set()


def _check_endpoint_reachable(options: argparse.Namespace, max_nodes: int) -> None:
    """The rendezvous host resolves (within RESOLVE_DEADLINE_S), and node 0's static port is free."""
    from meshrun.launch.preflight import check_static_port, parse_endpoint

    if options.standalone:
        return
    if options.rdzv_endpoint:
        host, _ = parse_endpoint(options.rdzv_endpoint)
        flag = "--rdzv-endpoint"
    elif options.rdzv_backend == "static" and max_nodes > 1:
        host, flag = str(options.master_addr), "--master-addr"
    else:
        host = None
    if host is not None and not _resolves(host):
        raise LaunchError(
            f"{flag} {options.rdzv_endpoint or host!r}: host {host!r} does not resolve (no address within "
            f"{RESOLVE_DEADLINE_S:g} s); use node 0's address or host name, e.g. 10.0.0.1:29400")
    if options.rdzv_backend == "static":
        check_static_port(options)


def _resolves(host: str) -> bool:
    """True when getaddrinfo finds an address for host within RESOLVE_DEADLINE_S (a daemon thread:
    a stuck resolver cannot hold the launch)."""
    found: list[bool] = []

    def lookup() -> None:
        try:
            found.append(bool(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)))
        except (OSError, UnicodeError, ValueError):
            found.append(False)

    worker = threading.Thread(target=lookup, name="meshrun-resolve", daemon=True)
    worker.start()
    worker.join(RESOLVE_DEADLINE_S)
    return bool(found and found[0])
