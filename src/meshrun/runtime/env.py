"""Read and validate the environment a launcher (torchrun, meshrun launch, SLURM) gives a worker."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from meshrun.errors import EnvError

# The variables torchrun sets for every worker; a partial set is a stale environment.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process about its place in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    launched: bool  # False when started with plain `python script.py`


def _int_var(environ: Mapping[str, str], name: str, *, minimum: int) -> int:
    raw = environ[name]
    text = raw.strip()
    if not re.fullmatch(r"-?[0-9]+", text):
        raise EnvError(
            f"{name}={raw!r} is not an integer; unset it (`unset {name}`) or start the script "
            f"with `meshrun launch`, which sets it for every worker"
        )
    value = int(text)
    if value < minimum:
        raise EnvError(f"{name}={value} must be >= {minimum}; unset it or start with `meshrun launch`")
    return value


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Parse RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*; raise EnvError naming the bad variable."""
    environ = os.environ if environ is None else environ
    present = [name for name in ("RANK", "WORLD_SIZE") if name in environ]
    if not present:
        return LaunchEnv(0, 0, 1, 1, None, None, launched=False)
    if len(present) == 1:
        _int_var(environ, present[0], minimum=0)  # a malformed value is the first thing to fix
        missing = "WORLD_SIZE" if present == ["RANK"] else "RANK"
        raise EnvError(
            f"{present[0]} is set but {missing} is not: a stale launcher environment; "
            f"`unset {present[0]}` to run as one process, or start with `meshrun launch`"
        )
    world_size = _int_var(environ, "WORLD_SIZE", minimum=1)
    rank = _int_var(environ, "RANK", minimum=0)
    if rank >= world_size:
        raise EnvError(f"RANK={rank} must be < WORLD_SIZE={world_size}; fix or unset both")
    local_rank = _int_var(environ, "LOCAL_RANK", minimum=0) if "LOCAL_RANK" in environ else rank
    local_world_size = (
        _int_var(environ, "LOCAL_WORLD_SIZE", minimum=1) if "LOCAL_WORLD_SIZE" in environ else world_size
    )
    master_addr = environ.get("MASTER_ADDR")
    master_port = None
    if world_size > 1:
        if master_addr is None or not master_addr.strip():
            raise EnvError(
                "MASTER_ADDR is empty or unset while WORLD_SIZE>1; set it to the address of the "
                "rank-0 host (e.g. MASTER_ADDR=10.0.0.1), or let `meshrun launch` set it"
            )
        if "MASTER_PORT" not in environ:
            raise EnvError("MASTER_PORT is unset while WORLD_SIZE>1; let `meshrun launch` set it")
    if "MASTER_PORT" in environ:
        master_port = _int_var(environ, "MASTER_PORT", minimum=1 if world_size > 1 else 0)
        if master_port > 65535:
            raise EnvError(f"MASTER_PORT={master_port} is not a TCP port (1-65535)")
    return LaunchEnv(rank, local_rank, world_size, local_world_size, master_addr, master_port, True)
