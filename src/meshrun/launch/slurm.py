"""Under SLURM, derive the node count, node rank, job id and rendezvous endpoint from SLURM_*.

    #SBATCH --nodes=4 --ntasks-per-node=1
    srun meshrun train my.toml          # no --nnodes / --rdzv-* needed: one agent per node

Every node computes the same endpoint: the first host of the step's (else the job's) node list,
on port $MESHRUN_RDZV_PORT, else 29400 + job id % 2000, so two jobs that share a first node do
not share a store (two jobs on one c10d endpoint with different --rdzv-id silently join one
store, and the second dies when the first ends: docs/multinode.md). The list is expanded here
(`node[01-03,07]`), so no `scontrol` is needed. An option given on the command line always
wins; MESHRUN_SLURM=0 turns this off.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import re
from dataclasses import dataclass

from meshrun.errors import LaunchError

logger = logging.getLogger(__name__)

SLURM_PORT_BASE = 29400
SLURM_PORT_SPAN = 2000  # 29400-31399: below Linux's ephemeral range (32768+)
# torchrun's parser defaults: a value equal to these was not given on the command line.
_DEFAULTS = {"nnodes": "1:1", "rdzv_endpoint": "", "rdzv_id": "none", "rdzv_backend": "static"}


@dataclass(frozen=True)
class SlurmJob:
    """What SLURM says about this job step, as the launcher needs it."""

    job_id: str
    num_nodes: int
    node_id: int
    hosts: list[str]
    port: int

    @property
    def endpoint(self) -> str:
        return f"{self.hosts[0]}:{self.port}"


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list: 'a[01-03,07],b5,r[1-2]-n[1-2]' -> ['a01', 'a02', ...]."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices = [_expand_range(p[1:-1], item) if p.startswith("[") else [p] for p in parts if p]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise LaunchError(f"SLURM node list {text!r} has an unclosed '['; is SLURM_JOB_NODELIST intact?")
    items.append(current)
    return [i for i in (s.strip() for s in items) if i]


def _expand_range(body: str, item: str) -> list[str]:
    out = []
    for part in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match:
            raise LaunchError(f"SLURM node list item {item!r}: cannot read range {part!r} (expected N or N-M)")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(hi) < int(lo):
            raise LaunchError(f"SLURM node list item {item!r}: range {part!r} runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _int_env(environ: dict[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise LaunchError(f"${name}={value!r} is not a number; is this a SLURM job step?")
            return int(value)
    return None


def slurm_job(environ: dict[str, str] | None = None) -> SlurmJob | None:
    """The SLURM job this process runs in, or None outside SLURM (or with MESHRUN_SLURM=0)."""
    env = dict(os.environ if environ is None else environ)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id or env.get("MESHRUN_SLURM", "1") == "0":
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError("SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not; run inside the job "
                          "(sbatch/srun), or set MESHRUN_SLURM=0 to ignore SLURM")
    hosts = expand_hostlist(nodelist)
    num_nodes = _int_env(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or len(hosts)
    node_id = _int_env(env, "SLURM_NODEID") or 0
    port = _int_env(env, "MESHRUN_RDZV_PORT")
    if port is None:
        port = SLURM_PORT_BASE + (int(job_id) if job_id.isdigit() else sum(map(ord, job_id))) % SLURM_PORT_SPAN
    if not 0 < port < 65536:
        raise LaunchError(f"$MESHRUN_RDZV_PORT={port} is not a TCP port (1-65535)")
    if not hosts or node_id >= num_nodes:
        raise LaunchError(f"SLURM says node {node_id} of {num_nodes} on {nodelist!r}: inconsistent "
                          f"SLURM_NODEID/SLURM_NNODES; set --nnodes and --rdzv-endpoint yourself")
    return SlurmJob(job_id=job_id, num_nodes=num_nodes, node_id=node_id, hosts=hosts, port=port)


def slurm_options(args: argparse.Namespace, job: SlurmJob | None) -> dict[str, str]:
    """--nnodes, --rdzv-backend/-endpoint/-id from SLURM, for those the user left out (a dict of
    namespace attribute -> value; the namespace itself is not changed)."""
    if job is None:
        return {}
    given = {k for k, default in _DEFAULTS.items() if str(getattr(args, k, default)) != default}
    if args.standalone or args.master_port is not None or getattr(args, "master_addr", None) not in (None, "127.0.0.1"):
        return {}  # the user chose a static or standalone rendezvous: theirs to run
    options: dict[str, str] = {}
    if "nnodes" not in given:
        options["nnodes"] = str(job.num_nodes)
    backend = options["rdzv_backend"] = args.rdzv_backend if "rdzv_backend" in given else "c10d"
    if "rdzv_endpoint" not in given and backend == "c10d":
        options["rdzv_endpoint"] = job.endpoint
    if "rdzv_id" not in given:
        options["rdzv_id"] = job.job_id
    logger.info("SLURM job %s: node %d of %d, rendezvous %s", job.job_id, job.node_id, job.num_nodes,
                options.get("rdzv_endpoint", args.rdzv_endpoint))
    return options
