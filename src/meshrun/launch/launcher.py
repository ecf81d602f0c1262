"""Build torchrun's LaunchConfig from `meshrun launch` arguments and run its elastic agent.

The pipeline is torchrun's own (parse → config_from_args → elastic_launch); meshrun only
changes defaults (auto nproc, free port, tee'd and prefixed logs), wraps Python workers in
`worker_main.py` so failures are recorded, and prints a summary when the job fails.

Restarts and several nodes get settings that torch 2.13 leaves to the user (docs/multinode.md):
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the store host role, the node's address and the socket
interface that routes to the rendezvous endpoint, and SLURM's node list and job id.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import uuid

from meshrun.debug.settings import apply_launch_args
from meshrun.errors import LaunchError
from meshrun.launch import attempts
from meshrun.launch.args import resolve_nproc_per_node
from meshrun.launch.network import node_network, worker_socket_env
from meshrun.launch.ports import describe_busy_port, port_in_use
from meshrun.launch.preflight import check_rendezvous, parse_endpoint
from meshrun.launch.slurm import apply_slurm
from meshrun.launch.summary import collect_failures, format_summary, record_launch_error

WORKER_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_main.py")
RANK_PREFIX = "[rank ${rank}] "
TORCH_JOIN_TIMEOUT_S = 600  # c10d rendezvous' join_timeout when --rdzv-conf does not set one
RENDEZVOUS_FAILED_EXIT = 1  # a rendezvous that cannot complete is a failed job, not bad input


def _max_nodes(nnodes: str) -> int:
    try:
        return int(nnodes.split(":")[-1])
    except ValueError:
        raise LaunchError(f"--nnodes={nnodes!r} must be N or MIN:MAX, e.g. --nnodes 2 or --nnodes 1:4") from None


def _choose_rendezvous(args: argparse.Namespace) -> None:
    """A single-node job without rendezvous flags gets c10d on a free port, as torchrun >=2.12."""
    if args.standalone or (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and _max_nodes(args.nnodes) == 1
    ):
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
        args.standalone = False
    if args.master_port is None:
        args.master_port = 29500
    elif args.rdzv_backend == "static" and args.node_rank == 0 and not args.rdzv_endpoint:
        if port_in_use(args.master_port):
            raise LaunchError(
                f"--master-port: {describe_busy_port(args.master_port)}; choose another "
                f"(e.g. --master-port {args.master_port + 1}) or leave it out and meshrun picks a free one"
            )


def _reliable_restarts() -> None:
    """Give each rendezvous round a fresh store for the workers, unless the user chose.

    torch 2.13 shares the agent's TCPStore with the workers by default; after a worker dies, the
    next attempt can reuse a stale store on the same MASTER_PORT and hang in `Gloo
    connectFullMesh failed ... Connection refused` (3 of 8 restarts in ../shared/FIELD-NOTES.md).
    With the sharing off, rank 0 of each attempt hosts a new store on a new port.
    """
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def _rdzv_conf_keys(conf: str) -> set[str]:
    return {item.split("=", 1)[0].strip() for item in (conf or "").split(",") if "=" in item}


def _configure_network(args: argparse.Namespace) -> None:
    """Several nodes over c10d: host role, node address and socket interface from the routes.

    Only what the user left unset: --rdzv-conf is_host, --local-addr, GLOO/NCCL_SOCKET_IFNAME.
    """
    if args.rdzv_backend != "c10d" or _max_nodes(args.nnodes) <= 1 or not args.rdzv_endpoint:
        return
    host, port = parse_endpoint(args.rdzv_endpoint)
    if port == 0:
        return
    try:
        bound = port_in_use(port)
    except OSError:
        bound = False
    net = node_network(host, port, port_bound_here=bound)
    if net.is_host and "is_host" not in _rdzv_conf_keys(args.rdzv_conf):
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, "is_host=1"]))
    if net.local_addr and not args.local_addr:
        args.local_addr = net.local_addr
    os.environ.update(worker_socket_env(net))


def _configure_logs(args: argparse.Namespace) -> None:
    """Tee every rank to per-rank files (for the failure summary) unless the user chose."""
    if not args.log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="meshrun-launch-")
    if args.tee == "0" and args.redirects == "0":
        args.tee = "3"
    if args.rank0_only and not args.local_ranks_filter:
        args.local_ranks_filter = "0"


def _quiet_torch_logs() -> None:
    # torchelastic's INFO/WARNING chatter buries the user's output; errors still show.
    if "LOGLEVEL" not in os.environ:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
        logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)


def build_launch(args: argparse.Namespace):
    """(LaunchConfig, entrypoint, entrypoint args) for a parsed `meshrun launch` namespace."""
    from torch.distributed.run import config_from_args

    args.nproc_per_node = resolve_nproc_per_node(args.nproc_per_node)
    apply_slurm(args)
    _choose_rendezvous(args)
    _configure_network(args)
    _configure_logs(args)
    _reliable_restarts()
    os.environ.update(apply_launch_args(args))  # hang watchdog and --debug settings for the workers
    if "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node not in ("1",):
        os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun does, without its banner
    try:
        config, cmd, cmd_args = config_from_args(args)
    except (AssertionError, ValueError, RuntimeError) as exc:
        raise LaunchError(f"invalid launch options: {exc}") from None
    if not args.no_prefix and not os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"):
        config.log_line_prefix_template = RANK_PREFIX
    if isinstance(cmd, str) and not args.no_python and not args.run_path:
        # [-u, (-m), target, ...] -> [-u, worker_main.py, (-m), target, ...]
        cmd_args = [cmd_args[0], WORKER_MAIN, *cmd_args[1:]]
    return config, cmd, cmd_args


def run_launch(args: argparse.Namespace) -> int:
    """Run the job to completion; print a failure summary and return the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    if not args.no_python and not args.module and not args.run_path and not os.path.isfile(args.training_script):
        raise LaunchError(f"script {args.training_script!r} not found; check the path (relative to {os.getcwd()})")
    try:
        config, cmd, cmd_args = build_launch(args)
        check_rendezvous(args)  # busy, foreign or another job's endpoint: one line, not a silent hang
    except LaunchError as exc:
        record_launch_error(args.log_dir, str(exc), "preflight")
        raise
    _quiet_torch_logs()
    recorder = attempts.install(args.log_dir, config.max_restarts, config.logs_specs)
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as exc:
        failures = collect_failures(exc, args.log_dir)
        sys.stdout.flush()
        print(format_summary(failures, args.log_dir, attempts=config.max_restarts + 1), file=sys.stderr)
        return failures[0].shell_exit_code
    except RendezvousError as exc:
        sys.stdout.flush()
        message = rendezvous_failure(exc, config)
        record_launch_error(args.log_dir, message, "rendezvous")
        print(message, file=sys.stderr)
        return RENDEZVOUS_FAILED_EXIT
    finally:
        attempts.uninstall(recorder)
    if recorder.lines:
        print(f"meshrun: the job succeeded after {len(recorder.lines)} failed attempt(s); "
              f"see {os.path.join(args.log_dir, attempts.FAILURES_FILE)}", file=sys.stderr)
    return 0


def rendezvous_failure(exc: Exception, config) -> str:
    """One line for a rendezvous that could not complete (e.g. too few nodes left)."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousTimeoutError,
    )

    nodes = f"{config.min_nodes}" if config.min_nodes == config.max_nodes else f"{config.min_nodes}:{config.max_nodes}"
    text = " ".join(str(exc).split())
    if isinstance(exc, RendezvousTimeoutError):
        join = config.rdzv_configs.get("join_timeout", TORCH_JOIN_TIMEOUT_S)
        return (f"meshrun: rendezvous {config.run_id!r} timed out: fewer than the minimum "
                f"{config.min_nodes} node(s) (--nnodes {nodes}) joined within join_timeout={join}s; "
                f"start the missing nodes, lower the minimum (e.g. --nnodes 1:{config.max_nodes}), "
                f"or raise --rdzv-conf join_timeout=SECONDS")
    if isinstance(exc, RendezvousClosedError):
        return f"meshrun: rendezvous {config.run_id!r} was closed by another node, which gave up; see its output"
    return (f"meshrun: rendezvous {config.run_id!r} at {config.rdzv_endpoint} failed "
            f"({type(exc).__name__}: {text[:200]}); is the node that hosts the endpoint still up?")
