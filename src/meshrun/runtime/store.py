"""A TCPStore server that listens only on the address its clients are told, not on every interface.

torch 2.13's TCPStore server binds every interface (`::`, dual-stack) whatever `host_name` says:
`host_name` only tells clients where to connect. The one way to choose the listening address is
`master_listen_fd`, a socket the caller bound and listens on. Every TCPStore torch's launcher and
`init_process_group` make as a server is `multi_tenant=True`, and a multi-tenant server is
shared by port within a process (TCPServer::start's cache). So a process that first holds a
server here, on the host and port torch is about to use, makes torch's own stores reuse it:

    with hold_server("127.0.0.1", port, one_node=True):   # the port is now served on loopback only
        dist.init_process_group("gloo")               # rank 0's TCPStore reuses that server

The rule: a store for clients told `host` listens on `host`'s own address, which is 127.0.0.1
(or ::1) for a loopback host on a single node, and the node's interface address on several nodes.
Where that address is not this machine's, or the port is taken, nothing is held and torch does
what it would (see docs/multinode.md, "Which ports listen where").
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
from collections.abc import Iterator
from datetime import timedelta

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048  # torch's own server listens with a large backlog: thousands of ranks connect at once
_NOT_HERE = (errno.EADDRNOTAVAIL, errno.EADDRINUSE, errno.EAFNOSUPPORT, errno.EACCES)


def bind_address(host: str, *, one_node: bool) -> tuple[int, str] | None:
    """(family, address) a server for clients told `host` should listen on; None when unknown.

    'localhost' is 127.0.0.1 (the address torch's clients try first for it); a literal address
    is itself; a name is the first address it resolves to, unless that is a loopback address
    and other nodes connect too (a host name /etc/hosts maps to 127.0.1.1 here resolves to the
    real address there: only every interface serves both).
    """
    host = host.strip("[]")
    if host == "localhost":
        return socket.AF_INET, "127.0.0.1"
    try:
        addr = ipaddress.ip_address(host)
        return (socket.AF_INET6 if addr.version == 6 else socket.AF_INET), str(addr)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return None
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            if not one_node and ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
                return None
            return family, sockaddr[0]
    return None


def listening_socket(host: str, port: int, *, one_node: bool) -> socket.socket | None:
    """A TCP socket listening on `host`'s address at `port` (0: a free one); None if that cannot be here."""
    where = bind_address(host, one_node=one_node)
    if where is None:
        return None
    family, addr = where
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((addr, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno in _NOT_HERE:
            return None  # not this machine's address, or the port is held: torch decides as it would
        raise
    return sock


@contextlib.contextmanager
def hold_server(host: str, port: int, *, one_node: bool) -> Iterator[object | None]:
    """Serve a multi-tenant TCPStore on `host`'s address at `port` while the block runs.

    one_node: every client runs on this machine (see bind_address).
    Yields the store (its `.port` is the port, useful when `port` is 0), or None when nothing
    could be bound here; torch's own multi-tenant TCPStore on the same port in this process
    shares the server, and keeps it alive after the block for as long as torch holds it.
    """
    sock = listening_socket(host, port, one_node=one_node)
    if sock is None:
        yield None
        return
    import os

    import torch.distributed as dist

    bound_port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        store = dist.TCPStore(host, bound_port, is_master=True, multi_tenant=True,
                              wait_for_workers=False, timeout=timedelta(seconds=60), master_listen_fd=fd)
    except (RuntimeError, ValueError) as exc:  # torch refused the socket: let torch bind as it would
        with contextlib.suppress(OSError):
            os.close(fd)
        logger.debug("meshrun: could not serve a store on %s:%s (%s)", host, port, exc)
        yield None
        return
    try:
        yield store
    finally:
        del store


def rank0_store(launch):  # noqa: ANN001 - a meshrun.runtime.env.LaunchEnv
    """Rank 0 hosts the job's store (unless the agent's is shared): on MASTER_ADDR only, not on `*`.

    init_process_group's multi-tenant TCPStore on MASTER_PORT reuses the server held here; on one
    node MASTER_ADDR is 127.0.0.1 (meshrun launch passes --local-addr). Elsewhere: a null context.
    """
    import os

    if (launch.rank != 0 or not launch.master_addr or not launch.master_port
            or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)):
        return contextlib.nullcontext()
    return hold_server(launch.master_addr, launch.master_port,
                       one_node=launch.world_size == launch.local_world_size)


_HELD: list[object] = []  # the process-long rank 0 store of a plain script (hold_rank0_store)


def hold_rank0_store() -> None:
    """For a script that calls `init_process_group` itself: hold rank 0's store on MASTER_ADDR's
    address for the rest of the process (its env:// TCPStore reuses it). Never raises: a store
    that cannot be held here leaves torch to bind as it would."""
    from meshrun.runtime.env import read_launch_env

    try:
        held = rank0_store(read_launch_env())
        held.__enter__()
    except Exception as exc:  # noqa: BLE001 - a launcher variable torch itself will complain about
        logger.debug("meshrun: rank 0's store not held (%s)", exc)
        return
    _HELD.append(held)
