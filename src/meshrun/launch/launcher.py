"""Build torchrun's LaunchConfig from `meshrun launch` arguments and run its elastic agent.

The pipeline is torchrun's own (parse → config_from_args → elastic_launch); meshrun only
changes defaults (auto nproc, free port, tee'd and prefixed logs), wraps Python workers in
`worker_main.py` so failures are recorded, and prints a summary when the job fails.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import uuid

from meshrun.errors import LaunchError
from meshrun.launch.args import resolve_nproc_per_node
from meshrun.launch.ports import describe_busy_port, port_in_use
from meshrun.launch.preflight import check_rendezvous
from meshrun.launch.summary import collect_failures, format_summary

WORKER_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_main.py")
RANK_PREFIX = "[rank ${rank}] "


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
    _choose_rendezvous(args)
    _configure_logs(args)
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
    from torch.distributed.launcher.api import elastic_launch

    if not args.no_python and not args.module and not args.run_path and not os.path.isfile(args.training_script):
        raise LaunchError(f"script {args.training_script!r} not found; check the path (relative to {os.getcwd()})")
    config, cmd, cmd_args = build_launch(args)
    check_rendezvous(args)  # busy, foreign or another job's endpoint: one line, not a silent hang
    _quiet_torch_logs()
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as exc:
        failures = collect_failures(exc, args.log_dir)
        sys.stdout.flush()
        print(format_summary(failures, args.log_dir, attempts=config.max_restarts + 1), file=sys.stderr)
        return failures[0].shell_exit_code
    return 0
