"""torchrun's command line (torch.distributed.run.get_args_parser), rebuilt without importing torch.

`meshrun train` and `meshrun launch` parse and check every option before torch is imported, so a
mistake costs a fraction of a second (benchmarks/reject_time.py). The flags, their `dest`, types,
defaults and `PET_*` environment defaults are torch 2.13's; tests/unit/test_launch_args.py compares
this parser with torch's own, so a torch release that changes one fails there, not on a user.

A parse error is one LaunchError line (`meshrun.argparser.OneLineParser`, which names the nearest
flag for an unknown one) instead of argparse's usage block and SystemExit.
"""

from __future__ import annotations

import argparse
import os

from meshrun.argparser import OneLineParser
from meshrun.errors import LaunchError

START_METHODS = ("spawn", "fork", "forkserver")
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")  # torch.numa.binding.AffinityMode


class env(argparse.Action):
    """torch.distributed.argparse_util.env: the default comes from $PET_<DEST> when it is set."""

    def __init__(self, dest, default=None, required=False, **kwargs) -> None:
        default = os.environ.get(f"PET_{dest.upper()}", default)
        if default:
            required = False
        super().__init__(dest=dest, default=default, required=required, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


class check_env(argparse.Action):
    """torch.distributed.argparse_util.check_env: store_true, or $PET_<DEST>=1."""

    def __init__(self, dest, default=False, **kwargs) -> None:
        raw = os.environ.get(f"PET_{dest.upper()}", "1" if default else "0")
        try:
            default = bool(int(raw))
        except ValueError:
            raise LaunchError(f"$PET_{dest.upper()}={raw!r}: expected 0 or 1") from None
        super().__init__(dest=dest, const=True, default=default, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const)


def comma_separated_list(value: str) -> list[str]:
    """torchrun's --duplicate-*-filters: 'a,b' -> ['a', 'b']; ',,' is an escaped comma."""
    placeholder = "<COMMA_PLACEHOLDER>"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


# (option strings, action, type, default, extra): torch 2.13's get_args_parser, in its order.
_FLAGS: list[tuple[tuple[str, ...], type | None, object, object, dict]] = [
    (("--nnodes",), env, str, "1:1", {}),
    (("--nproc-per-node", "--nproc_per_node"), env, str, "1", {}),
    (("--rdzv-backend", "--rdzv_backend"), env, str, "static", {}),
    (("--rdzv-endpoint", "--rdzv_endpoint"), env, str, "", {}),
    (("--rdzv-id", "--rdzv_id"), env, str, "none", {}),
    (("--rdzv-conf", "--rdzv_conf"), env, str, "", {}),
    (("--standalone",), check_env, None, None, {}),
    (("--max-restarts", "--max_restarts"), env, int, 0, {}),
    (("--monitor-interval", "--monitor_interval"), env, float, 0.1, {}),
    (("--start-method", "--start_method"), env, str, "spawn", {"choices": list(START_METHODS)}),
    (("--event-log-handler", "--event_log_handler"), env, str, "null", {}),
    (("--role",), env, str, "default", {}),
    (("-m", "--module"), check_env, None, None, {}),
    (("--no-python", "--no_python"), check_env, None, None, {}),
    (("--run-path", "--run_path"), check_env, None, None, {}),
    (("--log-dir", "--log_dir"), env, str, None, {}),
    (("-r", "--redirects"), env, str, "0", {}),
    (("-t", "--tee"), env, str, "0", {}),
    (("--local-ranks-filter", "--local_ranks_filter"), env, str, "", {}),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), env, comma_separated_list, [], {}),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), env, comma_separated_list, [], {}),
    (("--node-rank", "--node_rank"), env, int, 0, {}),
    (("--master-addr", "--master_addr"), env, str, "127.0.0.1", {}),
    (("--master-port", "--master_port"), env, int, None, {}),
    (("--local-addr", "--local_addr"), env, str, None, {}),
    (("--logs-specs", "--logs_specs"), None, str, None, {}),
    (("--numa-binding", "--numa_binding"), None, str, None, {"choices": list(NUMA_BINDINGS)}),
    (("--signals-to-handle", "--signals_to_handle"), env, str, "SIGTERM,SIGINT,SIGHUP,SIGQUIT", {}),
    (("--shutdown-timeout", "--shutdown_timeout"), env, int, None, {}),
    (("--virtual-local-rank", "--virtual_local_rank"), check_env, None, None, {}),
]

_HELP = {
    "--nnodes": "Number of nodes, or the range of nodes in form <minimum_nodes>:<maximum_nodes>.",
    "--nproc-per-node": "Number of workers per node; supported values: [auto, cpu, gpu, xpu, int].",
    "--rdzv-backend": "Rendezvous backend: static, c10d, etcd, etcd-v2.",
    "--rdzv-endpoint": "Rendezvous backend endpoint; usually in form <host>:<port>.",
    "--rdzv-id": "User-defined group id.",
    "--rdzv-conf": "Additional rendezvous configuration (<key1>=<value1>,<key2>=<value2>,...).",
    "--standalone": "Start a local standalone rendezvous backend on a free port (single node).",
    "--max-restarts": "Maximum number of worker group restarts before failing.",
    "--monitor-interval": "Interval, in seconds, to monitor the state of workers.",
    "--start-method": "Multiprocessing start method to use when creating workers.",
    "--event-log-handler": "Name of a registered event logging handler (console, dynamic_rendezvous, null).",
    "--role": "User-defined role for the workers.",
    "-m": "Interpret the launch script as a Python module, as 'python -m'.",
    "--no-python": "Execute the training script directly, without prepending 'python'.",
    "--run-path": "Run the training script with runpy.run_path in the same interpreter.",
    "--log-dir": "Base directory to use for log files.",
    "-r": "Redirect std streams into a log file in the log directory (e.g. -r 3, -r 0:1,1:2).",
    "-t": "Tee std streams into a log file and also to console (see --redirects for format).",
    "--local-ranks-filter": "Only show logs from these local ranks in console (e.g. 0,1,2).",
    "--duplicate-stdout-filters": "Duplicate stdout lines matching any of these comma-separated filters to a file.",
    "--duplicate-stderr-filters": "Duplicate stderr lines matching any of these comma-separated filters to a file.",
    "--node-rank": "Rank of the node for multi-node training (static rendezvous only).",
    "--master-addr": "Address of the master node (rank 0), static rendezvous only.",
    "--master-port": "Port on the master node (rank 0), static rendezvous only; 1-65535. Defaults to 29500.",
    "--local-addr": "Address of the local node; default: looked up, else the machine's FQDN.",
    "--logs-specs": "torchrun.logs_specs group entrypoint name, value must be type of LogsSpecs.",
    "--numa-binding": "Bind worker processes to CPUs near their assigned GPUs.",
    "--signals-to-handle": "Comma-separated list of signals to handle and forward to subprocesses.",
    "--shutdown-timeout": "Seconds to wait for graceful shutdown of workers before SIGKILL (default 30).",
    "--virtual-local-rank": "LOCAL_RANK 0 for all workers, each seeing only its GPU.",
}


def torchrun_parser() -> OneLineParser:
    """torchrun's parser: every flag with torch's spelling, dest, type and default; no torch import."""
    parser = OneLineParser(description="Torch Distributed Elastic Training Launcher")
    for flags, action, typ, default, extra in _FLAGS:
        kwargs = dict(extra, help=_HELP.get(flags[0]))
        if action is not None:
            kwargs["action"] = action
        if typ is not None:
            kwargs["type"] = typ
        if action is not check_env:
            kwargs["default"] = default
        parser.add_argument(*flags, **kwargs)
    parser.add_argument("training_script", type=str, help="the training script, then its arguments")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser
