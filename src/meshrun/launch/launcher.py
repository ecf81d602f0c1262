"""Run a LaunchSpec under torchrun's elastic agent; on failure, print who failed first and why.

The pipeline is torchrun's own (parse → config_from_args → elastic_launch), reached through
torch_elastic.py; the decisions meshrun adds (auto nproc, free port, SLURM, network, tee'd and
prefixed logs, the job's environment) are made once, in spec.py. Python workers are wrapped in
`worker_main.py` so failures are recorded, and a failed job ends with a summary (summary.py).
What only a failure needs is imported when it happens: the time to the user's first line is
torchrun's plus as little as possible (benchmarks/launch_overhead.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from meshrun.errors import LaunchError, shown
from meshrun.launch import attempts
from meshrun.launch.preflight import check_rendezvous
from meshrun.launch.spec import RANK_PREFIX, WORKER_MAIN, LaunchSpec, launch_spec

__all__ = ["RANK_PREFIX", "WORKER_MAIN", "build_launch", "rendezvous_failure", "run_launch", "run_spec"]

RENDEZVOUS_FAILED_EXIT = 1  # a rendezvous that cannot complete is a failed job, not bad input


def run_launch(args: argparse.Namespace) -> int:
    """Plan a parsed `meshrun launch` namespace and run it (see run_spec)."""
    try:
        plan = launch_spec(args)
    except LaunchError as exc:
        from meshrun.launch.summary import record_launch_error

        record_launch_error(args.log_dir or None, str(exc), "preflight")
        raise
    return run_spec(plan)


def check_log_dir(log_dir: str | None) -> None:
    """Create a --log-dir the user gave, or one line (LaunchError): before `meshrun train` creates
    its run directory, so a log directory that cannot be made leaves nothing behind."""
    if log_dir:
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as exc:
            raise _log_dir_error(log_dir, exc) from None


def _log_dir_error(log_dir: str, exc: OSError) -> LaunchError:
    return LaunchError(f"--log-dir {shown(log_dir)} cannot be created ({exc.strerror or exc}); "
                       "give a directory you can write, or leave --log-dir out")


def build_launch(plan: LaunchSpec, log_dir: str):
    """(LaunchConfig, entrypoint, entrypoint args) for a plan whose logs go to `log_dir`."""
    from meshrun.launch import torch_elastic

    try:
        config, cmd, cmd_args = torch_elastic.build_config(plan.torch_options(log_dir), plan.env)
    except (AssertionError, ValueError, RuntimeError) as exc:
        raise LaunchError(f"invalid launch options: {exc}") from None
    except OSError as exc:  # torch creates the log directory here (e.g. under /proc: access() said yes)
        raise _log_dir_error(log_dir, exc) from None
    if plan.log_line_prefix:
        config.log_line_prefix_template = plan.log_line_prefix
    if plan.wrap_python and isinstance(cmd, str) and plan.preload:
        from meshrun.launch.preload import use_forkserver

        cmd, cmd_args = use_forkserver(config, cmd_args)  # pre-imported: forked from a server (preload.py)
    elif plan.wrap_python and isinstance(cmd, str):
        # [-u, (-m), target, ...] -> [-u, worker_main.py, (-m), target, ...]
        cmd_args = [cmd_args[0], WORKER_MAIN, *cmd_args[1:]]
    return config, cmd, cmd_args


def run_spec(plan: LaunchSpec) -> int:
    """Run the job to completion; print a failure summary and return the exit code."""
    from meshrun.launch import torch_elastic

    options = plan.options
    if not options.no_python and not options.module and not options.run_path \
            and not os.path.isfile(options.training_script):
        raise LaunchError(f"script {options.training_script!r} not found; check the path (relative to {os.getcwd()})")
    log_dir = plan.log_dir or tempfile.mkdtemp(prefix="meshrun-launch-")
    try:
        config, cmd, cmd_args = build_launch(plan, log_dir)
        check_rendezvous(options)  # busy, foreign or another job's endpoint: one line, not a silent hang
    except LaunchError as exc:
        from meshrun.launch.summary import record_launch_error

        if plan.log_dir is None:  # a temp dir nobody is told of: the one line is the whole record
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            record_launch_error(log_dir, str(exc), "preflight")
        raise
    if plan.preload:
        from meshrun.launch.preload import start_server

        start_server(torch_elastic.agent_environ(config, plan.env))  # forked from here when safe; else the agent starts Python's
    exits: dict = {}  # each worker's end, as the agent saw it: names a rank that left early (summary.py)
    recorder = attempts.install(log_dir, config.max_restarts, config.logs_specs, exits=exits)
    try:
        torch_elastic.run_agent(config, cmd, cmd_args, plan.env, quiet=plan.quiet_torch_logs, exits=exits)
    except torch_elastic.ChildFailedError as exc:
        from meshrun.launch.summary import collect_failures, format_summary

        failures = collect_failures(exc, log_dir, verbose=getattr(options, "verbose", False), exits=exits)
        sys.stdout.flush()
        print(format_summary(failures, log_dir, attempts=config.max_restarts + 1), file=sys.stderr)
        _warn_if_disk_full(log_dir)
        return failures[0].shell_exit_code
    except torch_elastic.RendezvousError as exc:
        from meshrun.launch.summary import record_launch_error

        sys.stdout.flush()
        message = rendezvous_failure(exc, config)
        record_launch_error(log_dir, message, "rendezvous")
        print(message, file=sys.stderr)
        return RENDEZVOUS_FAILED_EXIT
    finally:
        attempts.uninstall(recorder)
        if plan.preload:
            from meshrun.launch.preload import stop_server

            stop_server()
    if recorder.lines:
        print(f"meshrun: the job succeeded after {len(recorder.lines)} failed attempt(s); "
              f"see {os.path.join(log_dir, attempts.FAILURES_FILE)}", file=sys.stderr)
    elif plan.log_dir is None:  # a clean run in a temp dir nobody asked for: leave nothing behind
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


LOW_DISK_BYTES = 1 << 20  # below this, a rank's last lines and error file were likely cut short


def _warn_if_disk_full(log_dir: str) -> None:
    """A failed job on a full disk: its ranks may not have been able to write why (one line)."""
    from meshrun.runtime.diskfault import free_bytes, human_bytes

    free = free_bytes(log_dir)
    if free is not None and free < LOW_DISK_BYTES:
        print(f"meshrun: the filesystem holding {log_dir} has {human_bytes(free)} free: the ranks' "
              f"output and error files above may be cut short; free space there and re-run", file=sys.stderr)


def rendezvous_failure(exc: Exception, config) -> str:
    """One line for a rendezvous that could not complete (e.g. too few nodes left)."""
    from meshrun.launch.torch_elastic import (
        JOIN_TIMEOUT_DEFAULT_S,
        RendezvousClosedError,
        RendezvousTimeoutError,
    )

    nodes = f"{config.min_nodes}" if config.min_nodes == config.max_nodes else f"{config.min_nodes}:{config.max_nodes}"
    text = " ".join(str(exc).split())
    if isinstance(exc, RendezvousTimeoutError):
        join = config.rdzv_configs.get("join_timeout", JOIN_TIMEOUT_DEFAULT_S)
        return (f"meshrun: rendezvous {config.run_id!r} timed out: fewer than the minimum "
                f"{config.min_nodes} node(s) (--nnodes {nodes}) joined within join_timeout={join}s; "
                f"start the missing nodes, lower the minimum (e.g. --nnodes 1:{config.max_nodes}), "
                f"or raise --rdzv-conf join_timeout=SECONDS")
    if isinstance(exc, RendezvousClosedError):
        return f"meshrun: rendezvous {config.run_id!r} was closed by another node, which gave up; see its output"
    return (f"meshrun: rendezvous {config.run_id!r} at {config.rdzv_endpoint} failed "
            f"({type(exc).__name__}: {text[:200]}); is the node that hosts the endpoint still up?")
