"""A connection of its own to the job's c10d store, for fingerprints and the watchdog.

Its own TCP connection, so a thread polling it never queues behind a blocked call on the
default group's store; keys are prefixed with the run id and restart count, so attempts
of one job and different jobs never mix.
"""

from __future__ import annotations

import os
from datetime import timedelta


def key_prefix(environ=None) -> str:
    environ = os.environ if environ is None else environ
    return "meshrun/debug/{}/{}/".format(
        environ.get("TORCHELASTIC_RUN_ID", "none"), environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def listening(environ=None) -> bool:
    """MASTER_ADDR:MASTER_PORT accepts connections (rank 0 serves it from its init_process_group on).

    A plain socket, and silent: a TCPStore client that finds nothing there logs C++ stacks as it retries.
    """
    import socket

    environ = os.environ if environ is None else environ
    host, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        return False
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        return False
    return True


def connect(timeout_s: float = 30.0):
    """A client PrefixStore on MASTER_ADDR:MASTER_PORT (the store torchrun set up), or None."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    except Exception:  # noqa: BLE001 - diagnostics must never break the job they watch
        return None
    return dist.PrefixStore(key_prefix(), store)
