"""`meshrun launch`'s decisions, read once from the arguments, the environment and SLURM.

`launch_spec(args)` reads and decides; it changes nothing (not the namespace, not os.environ,
not the file system). The launcher (launcher.py) runs the spec. What meshrun adds to torchrun:

* `--nproc-per-node auto`; a single-node job without rendezvous flags gets c10d on a free port,
  as torchrun >= 2.12 does, so two jobs at once never collide;
* under SLURM, --nnodes and --rdzv-* from SLURM_* (slurm.py), where the user left them out;
* one node: every listener on loopback (--local-addr 127.0.0.1, GLOO/NCCL_SOCKET_IFNAME=lo);
* several nodes over c10d: the store host role, the node's address and the gloo/NCCL interface
  from this machine's routes (network.py), where the user left them out;
* every rank tee'd to per-rank files (for the failure summary), lines prefixed [rank N];
* `meshrun train`'s workers forked from a server that has imported torch (preload.py);
* environment for the agent and its workers: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (reliable
  restarts, docs/multinode.md), OMP_NUM_THREADS=1 as torchrun sets it (without its banner), the
  hang watchdog's and --debug settings (meshrun.debug.settings), GLOO/NCCL_SOCKET_IFNAME.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshrun.debug.settings import apply_launch_args
from meshrun.launch.args import parse_nnodes, resolve_nproc_per_node
from meshrun.launch.preload import preloads
from meshrun.launch.rdzv_defaults import with_rdzv_defaults

if TYPE_CHECKING:
    from meshrun.launch.network import NodeNetwork
    from meshrun.launch.slurm import SlurmJob

WORKER_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_main.py")
RANK_PREFIX = "[rank ${rank}] "
STATIC_MASTER_PORT = 29500  # torchrun's --master-port default for a static rendezvous
# With it, each rendezvous round gives the workers a fresh store: torch 2.13 shares the agent's
# TCPStore with the workers by default, and after a worker dies the next attempt can reuse a
# stale store on the same MASTER_PORT and hang in `Gloo connectFullMesh failed ... Connection
# refused` (3 of 8 restarts measured; docs/multinode.md). Rank 0 of each attempt then hosts a
# new store on a new port.
RELIABLE_RESTARTS = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True)
class LaunchSpec:
    """What to run and how: torchrun's options as meshrun resolved them, plus the job's environment."""

    options: argparse.Namespace  # torchrun's options (a private copy) as config_from_args reads them
    env: Mapping[str, str] = field(default_factory=dict)  # set for the agent and workers while the job runs
    log_dir: str | None = None  # None: a new directory under the system temp dir, made when the job starts
    wrap_python: bool = True  # run Python targets through worker_main.py (records failures)
    preload: bool = False  # fork the workers from a server that has imported torch (meshrun train's; preload.py)
    log_line_prefix: str | None = RANK_PREFIX  # None: torch's (none, or $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)
    quiet_torch_logs: bool = True  # torchelastic's INFO/WARNING chatter off, unless $LOGLEVEL is set
    slurm: SlurmJob | None = None
    network: NodeNetwork | None = None

    @property
    def nproc_per_node(self) -> str:
        return str(self.options.nproc_per_node)

    @property
    def nnodes(self) -> str:
        return str(self.options.nnodes)

    def with_run(self, *, log_dir: str | None = None, script_args: list[str] | None = None) -> LaunchSpec:
        """The same spec with another --log-dir and/or training script arguments (a new spec)."""
        options = argparse.Namespace(**vars(self.options))
        if script_args is not None:
            options.training_script_args = list(script_args)
        return dataclasses.replace(self, options=options, log_dir=log_dir if log_dir is not None else self.log_dir)

    def torch_options(self, log_dir: str) -> argparse.Namespace:
        """The namespace handed to torch's config_from_args, with the job's log directory."""
        options = argparse.Namespace(**vars(self.options))
        options.log_dir = log_dir
        if options.master_port is None:
            options.master_port = STATIC_MASTER_PORT
        return options


def checked_options(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """A copy of the parsed options with SLURM's filled in, every option checked (checks.py);
    torch-free and changes nothing, so a mistake is one line before anything starts."""
    from meshrun.launch.checks import check_launch_options

    environ = dict(os.environ if environ is None else environ)
    options = argparse.Namespace(**vars(args))
    job = _slurm(environ)
    if job is not None:
        from meshrun.launch.slurm import slurm_options

        vars(options).update(slurm_options(options, job))
    parse_nnodes(options.nnodes)  # N or MIN:MAX, else one LaunchError naming the flag
    check_launch_options(options, environ)
    options.slurm_job = job
    return options


def launch_spec(args: argparse.Namespace, environ: Mapping[str, str] | None = None, *,
                checked: argparse.Namespace | None = None) -> LaunchSpec:
    """Resolve a parsed `meshrun launch` namespace into a LaunchSpec; `args` is left as it was.

    Raises LaunchError for options that cannot work (bad --nnodes or --nproc-per-node, bad timeouts).
    `checked`: what checked_options(args, environ) already returned (not checked twice).
    """
    environ = dict(os.environ if environ is None else environ)
    options = argparse.Namespace(**vars(checked if checked is not None else checked_options(args, environ)))
    job = options.slurm_job
    del options.slurm_job
    options.nproc_per_node = resolve_nproc_per_node(options.nproc_per_node)  # 'auto' asks torch
    vars(options).update(_rendezvous(options))
    env: dict[str, str] = {}
    network = _network(options)
    if network is not None:
        from meshrun.launch.network import worker_socket_env

        if network.is_host and "is_host" not in _rdzv_conf_keys(options.rdzv_conf):
            options.rdzv_conf = ",".join(filter(None, [options.rdzv_conf, "is_host=1"]))
        if network.local_addr and not options.local_addr:
            options.local_addr = network.local_addr
        env.update(worker_socket_env(network, environ))
    options.rdzv_conf = with_rdzv_defaults(options.rdzv_conf, backend=options.rdzv_backend,  # host loss in seconds
                                           max_nodes=parse_nnodes(options.nnodes)[1])
    if options.tee == "0" and options.redirects == "0":
        options.tee = "3"
    if options.rank0_only and not options.local_ranks_filter:
        options.local_ranks_filter = "0"
    env.update({k: v for k, v in RELIABLE_RESTARTS.items() if k not in environ})
    debug_options = argparse.Namespace(**vars(options))
    env.update(apply_launch_args(debug_options))  # hang watchdog and --debug settings for the workers
    options.rdzv_conf = debug_options.rdzv_conf  # with join_timeout raised to the init timeout, if needed
    if "OMP_NUM_THREADS" not in environ and options.nproc_per_node != "1":
        env["OMP_NUM_THREADS"] = "1"  # what torchrun does, without its banner
    prefix = None if options.no_prefix or environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") else RANK_PREFIX
    wrap = not options.no_python and not options.run_path
    # One OpenMP thread in the forkserver, or torch's import starts its pool there: no fork after that (preload.py)
    preload = wrap and preloads(bool(options.module), options.training_script, environ) \
        and env.get("OMP_NUM_THREADS", environ.get("OMP_NUM_THREADS")) == "1"
    return LaunchSpec(options, env, options.log_dir or None, wrap, preload, prefix, "LOGLEVEL" not in environ,
                      job, network)


def _rendezvous(options: argparse.Namespace) -> dict[str, object]:
    """A single-node job without rendezvous flags gets c10d on a free port, as torchrun >=2.12."""
    if options.standalone or (
        options.rdzv_backend == "static"
        and not options.rdzv_endpoint
        and options.master_port is None
        and parse_nnodes(options.nnodes)[1] == 1
    ):
        import uuid  # platform, on import: only a launch that runs needs it

        return {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0", "rdzv_id": str(uuid.uuid4()),
                "standalone": False}
    return {}


def _rdzv_conf_keys(conf: str | None) -> set[str]:
    return {item.split("=", 1)[0].strip() for item in (conf or "").split(",") if "=" in item}


def _slurm(environ: Mapping[str, str]) -> SlurmJob | None:
    # slurm.py decides; it is only imported where SLURM could be (a launch's first line waits for imports)
    if not (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")):
        return None
    from meshrun.launch.slurm import slurm_job

    return slurm_job(environ)


def _network(options: argparse.Namespace) -> NodeNetwork | None:
    """Several nodes over c10d: host role, node address and socket interface from the routes.

    One node: loopback only (network.loopback_network)."""
    if parse_nnodes(options.nnodes)[1] <= 1:
        from meshrun.launch.network import loopback_network

        return loopback_network()
    if options.rdzv_backend != "c10d" or not options.rdzv_endpoint:
        return None
    from meshrun.launch.network import node_network
    from meshrun.launch.ports import port_in_use
    from meshrun.launch.preflight import parse_endpoint

    host, port = parse_endpoint(options.rdzv_endpoint)
    if port == 0:
        return None
    try:
        bound = port_in_use(port)
    except OSError:
        bound = False
    return node_network(host, port, port_bound_here=bound)
