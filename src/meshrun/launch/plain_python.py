"""Explain a torchrun-style script started with plain `python`: give the `meshrun launch` command.

The guide's row "直接 python train.py 报环境变量缺失": a script that reads RANK/LOCAL_RANK from
os.environ, or calls `dist.init_process_group()` with the env:// default, fails under plain
`python script.py` with a bare KeyError or torch's "environment variable RANK expected, but not
set". `import meshrun` installs `sys.excepthook` (only when no launcher environment is present)
so that the traceback ends with one line giving the exact command to run instead.

Standard library only (os, sys at import; re, shlex when a hint is printed): this runs at
`import meshrun` time, in every plain-python process that imports meshrun.
"""

from __future__ import annotations

import os
import sys

# What torchrun (and meshrun launch) set for every worker.
LAUNCHER_VARS = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
)
# torch/distributed/rendezvous.py: _env_error(var)
_TORCH_ENV_ERROR = r"environment variable (\w+) expected, but not set"
MAX_CPU_PROCS = 4  # as `--nproc-per-node auto` (meshrun.launch.args.MAX_AUTO_CPU_PROCS)
_installed = False


def launcher_env_present(environ=None) -> bool:
    """True inside a launched worker (torchrun, meshrun launch, or a stale RANK/WORLD_SIZE)."""
    environ = os.environ if environ is None else environ
    return "RANK" in environ or "WORLD_SIZE" in environ


def missing_launcher_var(exc: BaseException) -> str | None:
    """The launcher variable whose absence raised `exc`, or None when it is something else."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and exc.args[0] in LAUNCHER_VARS:
        return exc.args[0]
    if isinstance(exc, ValueError):
        import re

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


def launch_command(argv: list[str] | None = None, nproc: int | None = None) -> str:
    """`meshrun launch --nproc-per-node N script args`, for this process's command line."""
    import shlex

    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0] or argv[0] == "-c":
        argv = ["script.py", *argv[1:]]
    return shlex.join(["meshrun", "launch", "--nproc-per-node", str(nproc or default_nproc()), *argv])


def default_nproc() -> int:
    """What `--nproc-per-node auto` would pick, without importing torch: GPUs, else 2-4 CPUs."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.accelerator.is_available():
                return max(1, torch.accelerator.device_count())
        except (AttributeError, RuntimeError):
            pass
    else:
        try:
            gpus = [d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()]
        except OSError:
            gpus = []
        if gpus:
            return len(gpus)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(2, min(MAX_CPU_PROCS, cores))


def install_excepthook() -> None:
    """Under plain `python` (no launcher env), end a missing-RANK traceback with the launch command.

    Cheap (no imports) and idempotent; chains to the hook already installed.
    """
    global _installed
    if _installed or launcher_env_present():
        return
    _installed = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):  # noqa: ANN001 - excepthook signature
        previous(exc_type, exc, tb)
        if "meshrun.cli" in sys.modules:
            return  # meshrun's own commands: a KeyError there is a bug, not a launch mistake
        line = explain_missing_launcher_env(exc)
        if line is None:  # DDP device_ids, FSDP forward, ...: meshrun.debug.explain
            from meshrun.debug.explain import explain

            hint = explain(exc_type.__name__, str(exc))
            line = f"meshrun: {hint}" if hint else None
        if line:
            print(line, file=sys.stderr)

    sys.excepthook = hook
