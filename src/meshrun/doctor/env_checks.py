"""`meshrun doctor`'s environment-variable checks: launcher leftovers, NCCL_* and OMP_NUM_THREADS.

Each function takes the environment as a mapping, so tests pass plain dicts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from meshrun.doctor.checks import FAIL, INFO, PASS, WARN, Check
from meshrun.errors import EnvError
from meshrun.runtime.device import usable_cpus
from meshrun.runtime.env import LAUNCH_VARS, read_launch_env

# Set per worker by torchrun; in an interactive shell they are left over from another job.
WORKER_VARS = (*LAUNCH_VARS, "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")

# NCCL variables that silently make every job slower (or noisier) when left exported.
# https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
DANGEROUS_NCCL = {
    "NCCL_P2P_DISABLE": "forces GPU-to-GPU traffic through host memory",
    "NCCL_IB_DISABLE": "turns off InfiniBand/RoCE, inter-node traffic falls back to TCP",
    "NCCL_SHM_DISABLE": "turns off shared-memory transport between local GPUs",
    "NCCL_NET_GDR_LEVEL": "overrides GPUDirect RDMA auto-detection",
    "NCCL_DEBUG": "logs every communicator set-up on every rank",
}
_OFF_VALUES = {"", "0", "false", "no", "off"}
_QUIET_DEBUG = {"", "WARN", "VERSION"}


def _dangerous(name: str, value: str) -> bool:
    if name == "NCCL_DEBUG":
        return value.strip().upper() not in _QUIET_DEBUG
    if name.endswith("_DISABLE"):
        return value.strip().lower() not in _OFF_VALUES
    return name in DANGEROUS_NCCL


def _shown(environ: Mapping[str, str], names: list[str]) -> str:
    return ", ".join(f"{name}={environ[name]!r}" for name in names)


def _is_uint(text: str) -> bool:
    text = text.strip()
    return text.isascii() and text.isdigit()  # not '²' or '1_000', which int() mishandles or allows


def _leftover_problem(environ: Mapping[str, str]) -> str | None:
    """Malformed MASTER_PORT/LOCAL_RANK/MASTER_ADDR when RANK/WORLD_SIZE are unset.

    read_launch_env returns early without RANK/WORLD_SIZE, so it never looks at these.
    """
    port = environ.get("MASTER_PORT")
    if port is not None:
        if not _is_uint(port) or int(port) > 65535:
            return f"MASTER_PORT={port!r} is not a TCP port (0-65535); unset it (`unset MASTER_PORT`) or fix it"
    local_rank = environ.get("LOCAL_RANK")
    if local_rank is not None and not _is_uint(local_rank):
        return f"LOCAL_RANK={local_rank!r} is not an integer >= 0; unset it (`unset LOCAL_RANK`)"
    addr = environ.get("MASTER_ADDR")
    if addr is not None and (not addr.strip() or any(ch.isspace() for ch in addr.strip())):
        return f"MASTER_ADDR={addr!r} is not a host name; unset it or set it to the rank-0 host's address"
    return None


def check_launch_env(environ: Mapping[str, str] | None = None) -> Check:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* left in the shell: malformed FAILs, stale WARNs."""
    environ = os.environ if environ is None else environ
    present = [name for name in WORKER_VARS if name in environ]
    if not present:
        return Check("launch env", PASS, "no RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set")
    shown = _shown(environ, present)
    try:
        env = read_launch_env(environ)
    except EnvError as exc:
        return Check("launch env", FAIL, f"malformed launcher variables: {shown}", str(exc))
    if not env.launched:
        problem = _leftover_problem(environ)
        if problem:
            return Check("launch env", FAIL, f"malformed launcher variables: {shown}", problem)
        return Check(
            "launch env",
            INFO,
            f"{shown} set without RANK/WORLD_SIZE",
            "launchers set their own values; unset these if they are left over from another job",
        )
    if "TORCHELASTIC_RUN_ID" in environ:
        return Check("launch env", INFO, f"running under a launcher: {shown}",
                     "nothing to do inside a worker; run `meshrun doctor` from a plain shell to check the machine")
    return Check(
        "launch env",
        WARN,
        f"stale launcher variables in this shell: {shown}",
        f"`python script.py` would act as rank {env.rank} of {env.world_size}; "
        f"`unset {' '.join(present)}` unless this shell is a worker",
    )


def check_nccl_env(environ: Mapping[str, str] | None = None) -> Check:
    """List NCCL_* (and TORCH_NCCL_*) settings; WARN on those that slow or flood every job."""
    environ = os.environ if environ is None else environ
    names = sorted(name for name in environ if name.startswith(("NCCL_", "TORCH_NCCL_")))
    if not names:
        return Check("nccl env", PASS, "no NCCL_* variables set")
    bad = [name for name in names if name in DANGEROUS_NCCL and _dangerous(name, environ[name])]
    if bad:
        reasons = "; ".join(f"{name} {DANGEROUS_NCCL[name]}" for name in bad)
        return Check("nccl env", WARN, _shown(environ, names),
                     f"`unset {' '.join(bad)}` unless you are debugging: {reasons}")
    return Check("nccl env", INFO, _shown(environ, names),
                 "these apply to every job started from this shell; unset any you did not mean to keep")


def check_omp(environ: Mapping[str, str] | None = None, *, num_cpus: int | None = None) -> Check:
    """OMP_NUM_THREADS: torchrun sets 1 per worker, mp.spawn does not (5-6x slower on CPU)."""
    environ = os.environ if environ is None else environ
    if num_cpus is None:
        num_cpus = usable_cpus()
    raw = environ.get("OMP_NUM_THREADS")
    if raw is None:
        return Check(
            "omp threads",
            INFO,
            f"OMP_NUM_THREADS unset; {num_cpus} CPU cores",
            "meshrun launch and torchrun set OMP_NUM_THREADS=1 per worker; set it yourself with mp.spawn",
        )
    try:
        threads = int(raw)
        if threads < 1:
            raise ValueError
    except ValueError:
        return Check("omp threads", WARN, f"OMP_NUM_THREADS={raw!r} is not a positive integer",
                     "`unset OMP_NUM_THREADS` or set it to an integer such as 1")
    if threads > num_cpus:
        return Check("omp threads", WARN, f"OMP_NUM_THREADS={threads} exceeds the {num_cpus} CPU cores",
                     f"oversubscribed threads slow every process; use at most {num_cpus} // processes per node")
    return Check("omp threads", PASS, f"OMP_NUM_THREADS={threads} ({num_cpus} CPU cores)")
