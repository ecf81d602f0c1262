"""Which of this host's addresses and interfaces reach a rendezvous endpoint, and who hosts it.

torch 2.13's agent guesses both from the host name (docs/multinode.md, "Two nodes on one
machine"): node 0 hosts the c10d store only when the endpoint matches its host name, the
address it publishes for MASTER_ADDR is `socket.getfqdn()`, and gloo binds whatever the host
name resolves to. A host name that maps to 127.0.x.1, or a host with several interfaces, breaks
all three. Here they are decided from the routing table and the interfaces' own addresses.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

from meshrun.launch.preflight import is_local_host

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (first) IPv4 address
_ANY_PUBLIC_ADDR = "203.0.113.1"  # TEST-NET-3: only a route lookup, no packet is sent


@dataclass(frozen=True)
class NodeNetwork:
    """What this node should tell torch: host the store or not, its address, its interface."""

    is_host: bool | None  # None: torch's own guess is right (loopback, or a host name match)
    local_addr: str | None  # the address peers reach this node at (MASTER_ADDR on node 0)
    ifname: str | None  # for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME


def route_source(host: str, port: int) -> str | None:
    """This host's address on the route to host:port (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect(sockaddr)
                return sock.getsockname()[0].split("%")[0]
        except OSError:
            continue
    return None


def interface_addresses() -> dict[str, list[str]]:
    """{interface name: its addresses}: IPv4 through ioctl, IPv6 from /proc/net/if_inet6."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found.setdefault(name, []).append(socket.inet_ntoa(packed[20:24]))
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as fp:
        for line in fp:
            fields = line.split()
            if len(fields) >= 6:
                addr = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
                found.setdefault(fields[5], []).append(addr)
    return found


def interface_of(addr: str) -> str | None:
    """The name of the interface that holds `addr`, e.g. 'eth0' (None when unknown)."""
    for name, addrs in interface_addresses().items():
        if addr in addrs:
            return name
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_network(host: str, port: int, *, port_bound_here: bool) -> NodeNetwork:
    """Decide this node's role and interface for a c10d rendezvous at host:port.

    is_host is only forced where torch would miss it: the endpoint is one of this machine's own
    non-loopback addresses and nobody here holds the port yet (a second agent on the same host
    must stay a client; torch's own loopback guess already falls back to one).
    """
    is_host = None
    if not _is_loopback(host) and not port_bound_here and is_local_host(host):
        is_host = True
    source = route_source(host, port)
    if source and not _is_loopback(host) and _is_loopback(source):
        # A host name that /etc/hosts maps to 127.0.x.1 on node 0 itself: its peers reach it
        # through the interface of the default route, not through lo.
        source = route_source(_ANY_PUBLIC_ADDR, 9) or source
    ifname = interface_of(source) if source else None
    return NodeNetwork(is_host=is_host, local_addr=source, ifname=ifname)


LOOPBACK_ADDR = "127.0.0.1"


def loopback_network() -> NodeNetwork:
    """A single node: MASTER_ADDR, rank 0's store and gloo/NCCL listen on loopback only.

    Nothing but this machine's own processes connects, so nothing listens where other hosts
    reach it (docs/multinode.md, "Which ports listen where").
    """
    return NodeNetwork(is_host=None, local_addr=LOOPBACK_ADDR, ifname=interface_of(LOOPBACK_ADDR) or "lo")


def worker_socket_env(net: NodeNetwork, environ: os._Environ | dict | None = None) -> dict[str, str]:
    """GLOO/NCCL_SOCKET_IFNAME for the workers, each only when the user has not set it."""
    environ = os.environ if environ is None else environ
    if not net.ifname:
        return {}
    return {var: net.ifname for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if var not in environ}
