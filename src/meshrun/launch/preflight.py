"""Check the rendezvous endpoint before the elastic agent starts, so its traps fail in seconds.

torch 2.13's c10d rendezvous has three traps (../shared/FIELD-NOTES.md, "Launch, ports, restarts"):

* an `--rdzv-endpoint` port held by a program that is not a c10d store: torchrun hangs without
  a word (still hung after 700 s);
* a second job pointed at a running job's endpoint with another `--rdzv-id`: it joins that job's
  store, trains, and dies with `RendezvousConnectionError` when the first job ends;
* an empty `$MASTER_ADDR` in `--rdzv-endpoint=$MASTER_ADDR:29400`: a ValueError about
  "dot-separated labels" from deep inside the agent.

`check_rendezvous(args)` looks at the endpoint the way the agent will and raises a one-line
LaunchError instead. A port nobody holds costs one bind(); only a port in use is probed with
torch's store handshake (spoken with the standard library, so that its deadline holds): 3 s for
a holder that does not run torch, 12 s otherwise. A remote endpoint that answers but not as a
store only gets a warning: a proxy that accepts every connection looks the same from here.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import random
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from meshrun.errors import LaunchError
from meshrun.launch.ports import free_port, port_holder, port_in_use

logger = logging.getLogger(__name__)

# torch's default when an endpoint has no port (c10d_rendezvous_backend.DEFAULT_PORT).
DEFAULT_RDZV_PORT = 29400
# How long a store may take to answer our handshake before we call the holder foreign. A real
# store answers in about a millisecond; a foreign program closes, answers garbage, or never
# answers. (torch's own client is no use here: it ignores its timeout against a silent peer.)
HANDSHAKE_DEADLINE_S = 3.0
# ... when the holder runs torch or cannot be inspected: torch's store server resolves each
# client's address (reverse DNS) before answering, which takes 5-10 s when a resolver drops a
# query (glibc: 5 s timeout, 2 attempts). A silent program that runs torch is rare.
TORCH_HOLDER_DEADLINE_S = 12.0
# Reading a proven store's keys with torch's client (a new connection: the same DNS stall, on
# both ends). Past this, the keys count as unknown and the job goes on.
KEYS_DEADLINE_S = 15.0
# A store seen between node 0 binding its port and writing its rendezvous key is empty: wait
# this long for the key before deciding.
EMPTY_STORE_GRACE_S = 2.0
CONNECT_TIMEOUT_S = 2.0
# torch/csrc/distributed/c10d/TCPStoreBackend.hpp: a client opens with QueryType::VALIDATE (0)
# and validationMagicNumber, then QueryType::PING (13) with a uint32 the server echoes back.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE
RDZV_KEY_PREFIX = "torch.rendezvous."  # C10dRendezvousBackend's state key is PREFIX + run_id
_HOST_RE = re.compile(r"^[\w.:-]+$")  # what torch's parse_rendezvous_endpoint accepts


@dataclass
class StoreProbe:
    """What answered at an endpoint: a c10d store (with its keys), or something else."""

    is_store: bool
    keys: list[str] = field(default_factory=list)

    @property
    def run_ids(self) -> list[str]:
        """The rdzv-ids whose rendezvous state lives in this store."""
        return sorted(k[len(RDZV_KEY_PREFIX):] for k in self.keys
                      if k.startswith(RDZV_KEY_PREFIX) and "/" not in k)


def check_rendezvous(args: argparse.Namespace) -> None:
    """Raise LaunchError when the job's rendezvous cannot work as given; return fast when it can.

    `args` is the parsed `meshrun launch` namespace (before or after meshrun fills in defaults).
    """
    if getattr(args, "standalone", False):
        return
    if args.rdzv_backend == "static":
        _check_static(args)
    elif args.rdzv_backend == "c10d":
        host, port = parse_endpoint(args.rdzv_endpoint)
        if port != 0:  # 0: the agent binds a free port itself
            _check_c10d_endpoint(host, port, args.rdzv_id, max_nodes(args.nnodes))


def _check_static(args: argparse.Namespace) -> None:
    addr = args.master_addr
    if addr is not None and not str(addr).strip():
        raise LaunchError(
            "--master-addr is empty: is $MASTER_ADDR empty? set it to node 0's address "
            "(e.g. export MASTER_ADDR=10.0.0.1) on every node"
        )


def max_nodes(nnodes: str | int) -> int:
    """The N of --nnodes N or MIN:N (torchrun's spelling); unparseable counts as multi-node."""
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        return 2


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


def _check_c10d_endpoint(host: str, port: int, run_id: str, nodes: int) -> None:
    where = f"--rdzv-endpoint {f'[{host}]' if ':' in host else host}:{port}"
    local = is_local_host(host)
    if local and not _bound_here(port):
        return  # the usual case on node 0: the agent will host the store here
    if not _accepts_connections(host, port):
        if local:  # bound, not listening: the agent can neither host the store nor reach one
            raise LaunchError(
                f"{where}: port {port} is bound on this host but accepts no connections; "
                f"choose another port, e.g. --rdzv-endpoint {host}:{free_port()}"
            )
        return  # node 0 is not up yet: the agent waits for it, as it should
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
        return
    _check_store_owner(where, run_id, nodes, probe, holder)


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
                       holder: str | None) -> None:
    held = f", {holder}" if holder else ""
    if run_id in probe.run_ids:
        if nodes > 1:
            return  # another node of this job got here first: join it
        raise LaunchError(
            f"{where} is already used by another job (the same --rdzv-id {run_id}{held}); this "
            f"job has one node, so it would run inside that job's rendezvous: choose another port, "
            f"or leave --rdzv-endpoint out and meshrun picks a free one"
        )
    if not probe.keys:
        return  # an empty store: nobody's rendezvous yet, the agent writes ours
    others = probe.run_ids
    who = f"rdzv-id {', '.join(others)}" if others else "a store with no c10d rendezvous in it"
    join = f", or --rdzv-id {others[0]} to join it as another node" if len(others) == 1 else ""
    raise LaunchError(f"{where} is already used by another job ({who}{held}); choose another port{join}")


def probe_store(host: str, port: int, run_id: str | None = None, *,
                deadline_s: float = HANDSHAKE_DEADLINE_S) -> StoreProbe:
    """Is a c10d store answering at host:port, and whose rendezvous does it hold?

    The handshake is torch's own, spoken with the standard library so that its deadline holds.
    run_id only matters for stores that cannot list their keys.
    """
    if not c10d_handshake(host, port, deadline_s):
        return StoreProbe(is_store=False)
    return StoreProbe(is_store=True, keys=_store_keys(host, port, run_id))


def c10d_handshake(host: str, port: int, deadline_s: float = HANDSHAKE_DEADLINE_S) -> bool:
    """True when host:port answers VALIDATE + PING as a torch TCPStore server does."""
    nonce = random.getrandbits(32)
    deadline = time.monotonic() + deadline_s
    try:
        with socket.create_connection((host, port), timeout=deadline_s) as sock:
            sock.sendall(struct.pack("=BI", _VALIDATE, _MAGIC) + struct.pack("=BI", _PING, nonce))
            reply = b""
            while len(reply) < 4:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = sock.recv(4 - len(reply))
                if not chunk:
                    return False  # hung up: not a store (a store keeps a valid client)
                reply += chunk
    except OSError:  # refused, reset, or silent past the deadline
        return False
    return struct.unpack("=I", reply)[0] == nonce


def _store_keys(host: str, port: int, run_id: str | None) -> list[str]:
    """The store's keys, read with torch's client in a thread bounded by KEYS_DEADLINE_S."""
    import torch.distributed as dist

    keys: list[str] = []
    done = threading.Event()

    def read() -> None:
        try:
            store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=KEYS_DEADLINE_S))
            keys.extend(_keys_after_grace(store, run_id))
            del store
        except Exception as exc:  # noqa: BLE001 - a store that breaks mid-way: keys unknown
            logger.debug("reading the keys of %s:%d: %s", host, port, exc)
        finally:
            done.set()

    threading.Thread(target=read, name="meshrun-store-keys", daemon=True).start()
    if not done.wait(KEYS_DEADLINE_S + EMPTY_STORE_GRACE_S):
        logger.debug("reading the keys of %s:%d took over %.0fs", host, port, KEYS_DEADLINE_S)
        return []
    return list(keys)


def _keys_after_grace(store, run_id: str | None) -> list[str]:
    deadline = time.monotonic() + EMPTY_STORE_GRACE_S
    while True:
        keys = _list_keys(store, run_id)
        if keys or time.monotonic() >= deadline:
            return keys
        time.sleep(0.1)


def _list_keys(store, run_id: str | None) -> list[str]:
    try:
        return list(store.list_keys())
    except (AttributeError, RuntimeError):  # a store without list_keys: ask for our key by name
        ours = RDZV_KEY_PREFIX + run_id if run_id else None
        if ours and store.check([ours]):
            return [ours]
        return ["<unlisted>"] * int(store.num_keys())
