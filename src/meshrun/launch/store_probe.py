"""Is a torch c10d store answering at host:port, and whose rendezvous does it hold?

torch's TCPStore handshake, spoken with the standard library so that a deadline holds (torch's
own client ignores its timeout against a peer that accepts and never answers), then the store's
keys read with torch's client in a thread bounded by KEYS_DEADLINE_S. Used by preflight.py.
"""

from __future__ import annotations

import logging
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

logger = logging.getLogger(__name__)

# How long a store may take to answer our handshake before we call the holder foreign. A real
# store answers in about a millisecond; a foreign program closes, answers garbage, or never
# answers.
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
# torch/csrc/distributed/c10d/TCPStoreBackend.hpp: a client opens with QueryType::VALIDATE (0)
# and validationMagicNumber, then QueryType::PING (13) with a uint32 the server echoes back.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE
RDZV_KEY_PREFIX = "torch.rendezvous."  # C10dRendezvousBackend's state key is PREFIX + run_id


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
