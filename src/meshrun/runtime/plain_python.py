"""Explain a torchrun-style script started with plain `python`: give the `meshrun launch` command.

The guide's row "直接 python train.py 报环境变量缺失": a script that reads RANK/LOCAL_RANK from
os.environ, or calls `dist.init_process_group()` with the env:// default, fails under plain
`python script.py` with a bare KeyError or torch's "environment variable RANK expected, but not
set". `meshrun.init()` without a launcher environment runs the script as one process and says
so with the command to use; if the script then fails for want of a launcher variable, the
excepthook that init() installs (runtime/session.py) ends the traceback with one line naming
the variable and the exact command. Importing meshrun alone installs nothing.
"""

from __future__ import annotations

import re
import shlex
import sys

from meshrun.runtime.device import auto_nproc_per_node

# What torchrun (and meshrun launch) set for every worker.
LAUNCHER_VARS = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
)
# torch/distributed/rendezvous.py: _env_error(var)
_TORCH_ENV_ERROR = r"environment variable (\w+) expected, but not set"


def missing_launcher_var(exc: BaseException) -> str | None:
    """The launcher variable whose absence raised `exc`, or None when it is something else."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and exc.args[0] in LAUNCHER_VARS:
        return exc.args[0]
    if isinstance(exc, ValueError):
        match = re.search(_TORCH_ENV_ERROR, str(exc))
        if match and "env://" in str(exc):
            return match.group(1)
    return None


def explain_missing_launcher_env(exc: BaseException, argv: list[str] | None = None) -> str | None:
    """One line naming the missing variable and the `meshrun launch` command, or None."""
    var = missing_launcher_var(exc)
    if var is None:
        return None
    return (
        f"meshrun: {var} is not set: this script expects a launcher (torchrun-style) but was "
        f"started with plain python; run: {launch_command(argv)}"
    )


def plain_python_hint(exc: BaseException) -> str | None:
    """The line to end a plain-python traceback with: the launch command, or meshrun's explanation."""
    line = explain_missing_launcher_env(exc)
    if line is None:  # DDP device_ids on CPU, FSDP forward, ...: meshrun.debug.explain
        from meshrun.debug.explain import explain_exception

        hint = explain_exception(exc)
        line = f"meshrun: {hint}" if hint else None
    return line


def launch_command(argv: list[str] | None = None, nproc: int | None = None) -> str:
    """`meshrun launch --nproc-per-node N script args`, for this process's command line.

    N defaults to what `meshrun launch` itself picks for `--nproc-per-node auto`.
    """
    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0] or argv[0] == "-c":
        argv = ["script.py", *argv[1:]]
    return shlex.join(["meshrun", "launch", "--nproc-per-node", str(nproc or auto_nproc_per_node()), *argv])
