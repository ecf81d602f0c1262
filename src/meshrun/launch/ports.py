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
