"""The `meshrun` command: one module per subcommand; this file only dispatches."""

from __future__ import annotations

import errno
import importlib
import os
import sys

from meshrun import __version__

COMMANDS = {
    "train": ("meshrun.cli.train", "train a model from a config (no config: the embedded default)"),
    "config": ("meshrun.cli.config", "show the fully resolved config: every key, default and doc"),
    "data": ("meshrun.cli.data", "tokenize text, .jsonl, .parquet or datasets dirs into a token directory (data prepare)"),
    "report": ("meshrun.cli.report", "render a run's loss/throughput/per-rank curves as PNG + HTML"),
    "plan": ("meshrun.cli.plan", "per-rank memory of each parallel layout; recommend one (--show: placements)"),
    "launch": ("meshrun.cli.launch", "start N workers of a script under torchrun's elastic agent"),
    "doctor": ("meshrun.cli.doctor", "check this machine for distributed training, with fixes"),
    "diagnose": ("meshrun.cli.diagnose", "post-mortem of a failed run: timeline, first failure, cause and fix"),
    "ckpt": ("meshrun.cli.ckpt", "list, inspect and export checkpoints (safetensors or torch)"),
    "generate": ("meshrun.cli.generate", "sample text from a run, a checkpoint or a Hugging Face directory"),
    "submit": ("meshrun.cli.submit", "write and submit a cluster job (SLURM sbatch script): --dry-run, --status, --cancel"),
}

USAGE = f"""\
usage: meshrun <command> [options]      (meshrun <command> --help for each)

meshrun {__version__}: launch, train and debug distributed PyTorch, on CPU (gloo) or GPUs (NCCL).

commands:
{{commands}}

examples:
  meshrun train                                    # the main job: the embedded default on CPU
  meshrun train examples/configs/tiny.toml --nproc-per-node 2 --set optim.lr=3e-3
  meshrun doctor                                   # is this machine ready?
  meshrun launch --nproc-per-node 4 train.py       # 4 workers, [rank N] output, failure summary
  python -m meshrun launch train.py                # the same, without the console script
"""


# What a path argument too long or looping gets from the filesystem, wherever a command first looks at it.
REFUSED_PATH_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP)
MACHINE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO)  # the machine failed, not the input: exit 1


def _usage() -> str:
    rows = "\n".join(f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items())
    return USAGE.format(commands=rows)


TERMINATED_EXIT = 128 + 15
INTERRUPTED_EXIT = 128 + 2
# Commands whose start-up only checks (nothing to undo): Ctrl-C there ends them at once too, never
# as a KeyboardInterrupt that can land inside an import (numpy turns one into an ImportError and a
# traceback). The others keep Python's KeyboardInterrupt: their work removes its partial files.
STOP_AT_ONCE_ON_SIGINT = ("train", "launch")


def _stop_at_once(name: str):
    """SIGTERM (and, for STOP_AT_ONCE_ON_SIGINT, SIGINT) before a command's own handling of it
    (torch's agent installs its own once it runs): one line and exit 143 (130) at once, instead of a
    process killed without a word or a traceback. No exception is raised: one raised
    asynchronously can land inside an import (a half-imported C extension) or in code that ignores
    it. Nothing needs undoing at that point: the checks create nothing, a claimed run directory's
    lock is taken over by the next run, and the preloaded server exits when this process does.
    Only in this process (a forked child gets the default back), only on the main thread, and only
    where the signal has Python's default handling; returns what puts them back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    wanted = [signal.SIGTERM] + ([signal.SIGINT] if name in STOP_AT_ONCE_ON_SIGINT else [])
    owner = os.getpid()

    def stop(signum, frame) -> None:  # noqa: ANN001 - signal handler signature
        if os.getpid() != owner:  # a forked child (a Pool worker, say): the default action
            signal.signal(signum, defaults[signum])
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        try:
            sys.stdout.flush()
            why = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "stopped by SIGTERM"
            os.write(2, f"meshrun {name}: {why}\n".encode())
        finally:
            os._exit(INTERRUPTED_EXIT if signum == signal.SIGINT else TERMINATED_EXIT)

    taken = [sig for sig in wanted if signal.getsignal(sig) is defaults[sig]]
    for sig in taken:
        signal.signal(sig, stop)

    def restore() -> None:
        for sig in taken:
            if signal.getsignal(sig) is stop:
                signal.signal(sig, defaults[sig])

    return restore


def run() -> None:
    """The `meshrun` console script and `python -m meshrun`: main(), then a quick exit (see quick_exit)."""
    try:
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before main's own handling is in place (measured: inside `import signal`)
        command = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in COMMANDS else ""
        os.write(2, f"meshrun{' ' + command if command else ''}: interrupted (Ctrl-C)\n".encode())
        code = INTERRUPTED_EXIT
    quick_exit(code)


def quick_exit(code: int) -> None:
    """Exit with `code`, skipping the interpreter's teardown of torch when nothing else needs it.

    A command that imported torch spends about half a second of CPU at exit freeing its modules one
    by one (`python -c "import torch, torch._dynamo"`: 2.2 s, 1.7 s with os._exit). Nothing of ours
    needs that teardown: what must happen at exit is registered with atexit (logging's flush,
    weakref finalizers, multiprocessing's cleanup), so those run first, then every open file is
    flushed, then os._exit. A non-daemon thread still running would be joined by a normal exit:
    then, and when torch was never imported, the exit is the normal one.
    """
    import threading

    if "torch" not in sys.modules or any(t is not threading.main_thread() and t.is_alive() and not t.daemon
                                         for t in threading.enumerate()):
        raise SystemExit(code)
    import atexit

    atexit._run_exitfuncs()
    _flush_open_files()
    os._exit(code)


def _flush_open_files() -> None:
    """Flush every file object still open, as their finalizers would at a normal exit."""
    import gc
    import io

    gc.unfreeze()  # what a gc.freeze() froze (a forked server's streams) is not listed by get_objects
    buffered = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():
        if issubclass(type(obj), buffered):  # type(), not isinstance(): no object's own __class__ is asked
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):  # a reader left (broken pipe) or a detached wrapper
                pass


def main(argv: list[str] | None = None) -> int:
    from meshrun.errors import MeshrunError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"meshrun {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean `meshrun {close[0]}`?" if close else ""
        print(f"meshrun: unknown command {name!r}{hint} (see `meshrun --help`)", file=sys.stderr)
        return 2
    restore = _stop_at_once(name)
    try:  # Ctrl-C or SIGTERM during the (slow) imports and checks is still one line
        module = importlib.import_module(COMMANDS[name][0])
        return int(module.main(argv[1:]) or 0)
    except MeshrunError as exc:
        print(f"meshrun {name}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"meshrun {name}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except BrokenPipeError:  # `meshrun diagnose --json | head`: the reader left; not an error of ours
        # (before OSError, its base class, whose branch re-raised it as a traceback)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a file the command could not read or write, that no check caught first
        if exc.filename is None:
            raise
        from meshrun.errors import shown

        if exc.errno in REFUSED_PATH_ERRNOS:
            print(f"meshrun {name}: error: {shown(exc.filename)} is not a usable path ({exc.strerror}); "
                  "give a shorter or existing path", file=sys.stderr)
            return 2
        print(f"meshrun {name}: error: {shown(exc.filename)}: {exc.strerror or exc}", file=sys.stderr)
        return 1 if exc.errno in MACHINE_ERRNOS else 2
    finally:
        restore()
