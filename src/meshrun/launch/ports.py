"""Free ports and who holds a busy one (Linux /proc; best effort elsewhere)."""

from __future__ import annotations

import errno
import os
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (for tools that must name a port up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# Ports a store can take that the OS never hands out by itself: below Linux's default ephemeral
# range (32768-60999, the ports of bind(0) and of every outgoing connection) and below torch's
# defaults (29400, 29500). A port picked from the ephemeral range and bound seconds later by rank 0
# can meanwhile become the local end of any connection on the machine (EADDRINUSE in rank 0).
QUIET_POOL = (10000, 28999)
PORT_RANGE_VAR = "MESHRUN_TEST_PORTS"  # LO-HI: a parallel test worker's own slice of QUIET_POOL


def quiet_pool_usable() -> bool:
    """Does QUIET_POOL lie below this machine's ephemeral range (Linux's ip_local_port_range)?"""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fp:
            return int(fp.read().split()[0]) > QUIET_POOL[1]
    except (OSError, ValueError, IndexError):
        return False


def free_port_in(lo: int, hi: int, host: str = "127.0.0.1") -> int | None:
    """A port of lo..hi that binds right now (none in TIME_WAIT either), from a random start; None if none."""
    import random

    ports = range(lo, hi + 1)
    start = random.randrange(len(ports))
    for port in (*ports[start:], *ports[:start]):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    return None


def quiet_port(host: str = "127.0.0.1", environ: dict[str, str] | None = None) -> int:
    """A free port for a store bound later by another process: MESHRUN_TEST_PORTS=LO-HI when set,
    else QUIET_POOL where it lies below this machine's ephemeral range, else the OS's choice."""
    spec = (os.environ if environ is None else environ).get(PORT_RANGE_VAR, "")
    if spec:
        try:
            lo, hi = (int(part) for part in spec.split("-"))
        except ValueError:
            raise ValueError(f"{PORT_RANGE_VAR}={spec!r}: expected LO-HI, e.g. 20000-20999") from None
        port = free_port_in(lo, hi, host)
        if port is None:
            raise OSError(f"{PORT_RANGE_VAR}={spec}: no free port in the range")
        return port
    if quiet_pool_usable():
        port = free_port_in(*QUIET_POOL, host)
        if port is not None:
            return port
    return free_port(host)


def port_in_use(port: int, host: str = "") -> bool:
    """True when binding `host:port` fails with EADDRINUSE (what torch's TCPStore would hit)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise  # EACCES (a privileged port), EADDRNOTAVAIL, ...: not "in use", say what it is
    return False


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fp:
                next(fp)
                for line in fp:
                    fields = line.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        inodes.add(inode)
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return inodes


def port_holder(port: int) -> str | None:
    """'pid 123 (python3 server.py)' for the process listening on `port`, when it can be known."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in targets for fd in fds):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as fp:
                cmd = " ".join(fp.read().replace(b"\0", b" ").decode(errors="replace").split())
            return f"pid {pid} ({cmd[:80]})"
        except OSError:
            continue
    return None


def describe_busy_port(port: int) -> str:
    holder = port_holder(port)
    return f"port {port} is already in use" + (f" by {holder}" if holder else "")
