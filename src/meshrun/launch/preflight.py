"""Check the rendezvous before the elastic agent starts, so that its traps fail in seconds.

torch 2.13's rendezvous has traps that make torchrun hang or fail late (docs/errors.md,
"Rendezvous traps on torch 2.13"):

* an `--rdzv-endpoint` port held by a program that is not a c10d store: torchrun hangs without
  a word (still hung after 700 s);
* a second job pointed at a running job's endpoint with another `--rdzv-id`: it joins that job's
  store, trains, and dies with `RendezvousConnectionError` when the first job ends;
* an empty `$MASTER_ADDR` in `--rdzv-endpoint=$MASTER_ADDR:29400`: a ValueError about
  "dot-separated labels" from deep inside the agent;
* a busy `--master-port` on a static rendezvous: EADDRINUSE from inside the agent.

`check_rendezvous(options)` looks at the endpoint the way the agent will and raises a one-line
LaunchError instead. A port nobody holds costs one bind(); only a port in use is probed with
torch's store handshake (store_probe.py): 3 s for a holder that does not run torch, 12 s
otherwise. A remote endpoint that answers but not as a store only gets a warning: a proxy that
accepts every connection looks the same from here.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import socket

from meshrun.errors import LaunchError
from meshrun.launch.args import parse_nnodes
from meshrun.launch.ports import describe_busy_port, free_port, port_holder, port_in_use
from meshrun.launch.store_probe import (
    HANDSHAKE_DEADLINE_S,
    TORCH_HOLDER_DEADLINE_S,
    StoreProbe,
    probe_store,
)

logger = logging.getLogger(__name__)

# torch's default when an endpoint has no port (c10d_rendezvous_backend.DEFAULT_PORT).
DEFAULT_RDZV_PORT = 29400
CONNECT_TIMEOUT_S = 2.0
_HOST_RE = re.compile(r"^[\w.:-]+$")  # what torch's parse_rendezvous_endpoint accepts

# What check_rendezvous found; each is fine for the job to go on.
STANDALONE = "standalone"  # torch picks everything itself
STATIC = "static"  # MASTER_ADDR:MASTER_PORT, checked
AGENT_BINDS = "agent binds a free port"  # c10d at port 0
WILL_HOST = "will host"  # the endpoint is here and free: this agent hosts the store
NOT_UP_YET = "not up yet"  # a remote endpoint that does not accept yet: the agent waits for it
NOT_A_STORE_REMOTE = "remote, not a store"  # warned, not refused (could be a proxy)
JOINS = "joins its job"  # the store holds this job's rendezvous: another node of the same job
EMPTY_STORE = "empty store"  # nobody's rendezvous yet: the agent writes ours


def check_rendezvous(options: argparse.Namespace) -> str:
    """Raise LaunchError when the job's rendezvous cannot work as given; else say what was found.

    `options` holds torchrun's rendezvous options (a `meshrun launch` namespace, or a LaunchSpec's
    options). Returns one of the verdicts above (STANDALONE, STATIC, WILL_HOST, JOINS, ...).
    """
    if getattr(options, "standalone", False):
        return STANDALONE
    if options.rdzv_backend == "static":
        _check_static(options)
        return STATIC
    if options.rdzv_backend != "c10d":
        return options.rdzv_backend  # etcd and others: torch's to check
    host, port = parse_endpoint(options.rdzv_endpoint)
    if port == 0:
        return AGENT_BINDS
    return _check_c10d_endpoint(host, port, options.rdzv_id, parse_nnodes(options.nnodes)[1])


def _check_static(options: argparse.Namespace) -> None:
    addr = options.master_addr
    if addr is not None and not str(addr).strip():
        raise LaunchError(
            "--master-addr is empty: is $MASTER_ADDR empty? set it to node 0's address "
            "(e.g. export MASTER_ADDR=10.0.0.1) on every node"
        )
    check_static_port(options)


def check_static_port(options: argparse.Namespace) -> None:
    """Node 0 of a static rendezvous hosts the store on --master-port (or the static
    --rdzv-endpoint's port): a port already bound on this host is one line, not EADDRINUSE
    from inside the agent."""
    if options.node_rank != 0:
        return
    if options.rdzv_endpoint:
        host, port = parse_endpoint(options.rdzv_endpoint)
        flag, fix = "--rdzv-endpoint", f"--rdzv-endpoint {host}:{port + 1 if port < 65535 else 29500}"
        if not is_local_host(host):
            return
    else:
        port, flag = getattr(options, "master_port", None), "--master-port"
        fix = f"--master-port {port + 1 if port and port < 65535 else 29500}"
    if port and _bound_here(port):
        raise LaunchError(
            f"{flag}: {describe_busy_port(port)}; choose another "
            f"(e.g. {fix}) or leave it out and meshrun picks a free one"
        )


def parse_endpoint(endpoint: str | None) -> tuple[str, int]:
    """(host, port) of a c10d --rdzv-endpoint, as torch reads it, with errors that name the fix.

    An empty endpoint is torch's localhost:29400 and a bare HOST gets port 29400, as in torchrun.
    """
    text = (endpoint or "").strip()
    if not text:
        return "localhost", DEFAULT_RDZV_PORT
    if text.startswith("[") and text.endswith("]"):
        host, port_text = text[1:-1], None
    elif ":" in text:
        host, port_text = text.rsplit(":", 1)
    else:
        host, port_text = text, None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise LaunchError(
            f"--rdzv-endpoint {text!r} has no host: is $MASTER_ADDR empty? set it to node 0's "
            f"address (e.g. export MASTER_ADDR=10.0.0.1) on every node"
        )
    if not _HOST_RE.match(host):
        raise LaunchError(
            f"--rdzv-endpoint {text!r}: {host!r} is not a host name or IP address; "
            f"use HOST:PORT with node 0's address, e.g. 10.0.0.1:{DEFAULT_RDZV_PORT}"
        )
    if port_text is None:
        return host, DEFAULT_RDZV_PORT
    if not port_text.strip():
        raise LaunchError(
            f"--rdzv-endpoint {text!r} has no port: is $MASTER_PORT empty? "
            f"use {host}:{DEFAULT_RDZV_PORT} (the same port on every node)"
        )
    if not port_text.strip().isdigit() or int(port_text) > 65535:
        raise LaunchError(
            f"--rdzv-endpoint {text!r}: port {port_text!r} is not a TCP port (0-65535); "
            f"use HOST:PORT, e.g. {host}:{DEFAULT_RDZV_PORT}"
        )
    return host, int(port_text)


def is_local_host(host: str) -> bool:
    """True when `host` is loopback or an address of this machine (one we can bind to)."""
    if host == "localhost":
        return True
    import ipaddress  # only multi-node or explicit endpoints get here; a launch's start need not wait for it

    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
                return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((sockaddr[0], 0))  # EADDRNOTAVAIL unless the address is ours
            return True
        except OSError:
            continue
    return False


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def _check_c10d_endpoint(host: str, port: int, run_id: str, nodes: int) -> str:
    where = f"--rdzv-endpoint {f'[{host}]' if ':' in host else host}:{port}"
    local = is_local_host(host)
    if local and not _bound_here(port):
        return WILL_HOST  # the usual case on node 0: the agent will host the store here
    if not _accepts_connections(host, port):
        if local:  # bound, not listening: the agent can neither host the store nor reach one
            raise LaunchError(
                f"{where}: port {port} is bound on this host but accepts no connections; "
                f"choose another port, e.g. --rdzv-endpoint {host}:{free_port()}"
            )
        return NOT_UP_YET  # node 0 is not up yet: the agent waits for it, as it should
    holder = _holder(port) if local else None
    # A store answers at once, unless its server stalls in a reverse DNS lookup of our address
    # (torch logs it on every connection; seconds with a flaky resolver). Only a holder known
    # not to run torch gets the short deadline; a remote one only ever gets a warning.
    patient = local and _may_run_torch(holder)
    probe = probe_store(host, port, run_id,
                        deadline_s=TORCH_HOLDER_DEADLINE_S if patient else HANDSHAKE_DEADLINE_S)
    if not probe.is_store and local:
        raise LaunchError(
            f"{where}: port {port} is held by {holder or 'another program'}, which is not a torch "
            f"c10d store (torchrun would hang here without a word); choose another port, "
            f"e.g. --rdzv-endpoint {host}:{free_port()}"
        )
    if not probe.is_store:
        # Remote: a foreign program, or a proxy that accepts any connection itself (some
        # networks have one). Only the first is a mistake, so say it, do not refuse.
        logger.warning(
            "meshrun launch: %s answers, but not as a torch c10d store; if the job hangs here, "
            "another program holds port %d on %s: choose another port, the same on every node",
            where, port, host,
        )
        return NOT_A_STORE_REMOTE
    return _check_store_owner(where, run_id, nodes, probe, holder)


def _holder(port: int) -> str | None:
    """port_holder's 'pid N (cmdline)', on one line (a `python -c` cmdline has newlines)."""
    holder = port_holder(port)
    return " ".join(holder.split()) if holder else None


def _may_run_torch(holder: str | None) -> bool:
    """False only when the holder's process is known and has no libtorch loaded."""
    match = re.match(r"pid (\d+) ", holder or "")
    if not match:
        return True  # unknown (e.g. another user's process): assume the worst case
    try:
        with open(f"/proc/{match.group(1)}/maps") as fp:
            return any("libtorch" in line for line in fp)
    except OSError:
        return True


def _bound_here(port: int) -> bool:
    try:
        return port_in_use(port)
    except OSError:  # e.g. EACCES on a privileged port: not ours to judge, torch will say
        return False


def _check_store_owner(where: str, run_id: str, nodes: int, probe: StoreProbe,
                       holder: str | None) -> str:
    held = f", {holder}" if holder else ""
    if run_id in probe.run_ids:
        if nodes > 1:
            return JOINS  # another node of this job got here first: join it
        raise LaunchError(
            f"{where} is already used by another job (the same --rdzv-id {run_id}{held}); this "
            f"job has one node, so it would run inside that job's rendezvous: choose another port, "
            f"or leave --rdzv-endpoint out and meshrun picks a free one"
        )
    if not probe.keys:
        return EMPTY_STORE  # an empty store: nobody's rendezvous yet, the agent writes ours
    others = probe.run_ids
    who = f"rdzv-id {', '.join(others)}" if others else "a store with no c10d rendezvous in it"
    join = f", or --rdzv-id {others[0]} to join it as another node" if len(others) == 1 else ""
    raise LaunchError(f"{where} is already used by another job ({who}{held}); choose another port{join}")
