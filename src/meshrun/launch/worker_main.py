"""Runs one worker's target script or module, recording a failure where the launcher finds it.

Started by `meshrun launch` as `python -u worker_main.py [-m] TARGET ARGS...`. Standard library
only, and imports nothing it does not need before the user's first line (json and traceback
only on failure; meshrun.debug only when the script imports torch), so user code starts as
soon as it would under torchrun. Torchelastic's `@record` does the same job, but only for
scripts that remember to use it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

_RUNPY = os.path.join(os.path.dirname(os.path.abspath(os.__file__)), "runpy.py")  # not imported for a .py
_SKIP_FILES = {os.path.abspath(__file__), _RUNPY, "<frozen runpy>"}


def _skipped(filename: str) -> bool:
    return filename in _SKIP_FILES or os.path.abspath(filename) in _SKIP_FILES


def _user_traceback(exc: BaseException):
    """The exception's traceback without this bootstrap's and runpy's frames on top."""
    tb = exc.__traceback__
    while tb is not None and _skipped(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _frames(tb) -> list[tuple[str, int, str]]:
    import traceback

    return [(fs.filename, fs.lineno or 0, fs.name) for fs in traceback.extract_tb(tb)]


def _explain(exc: BaseException) -> str | None:
    """meshrun's explanation of a torch error the guide warns about (meshrun.debug.explain).

    The frames tell one cause of several apart (where the error was raised: an optimizer step, a
    direct `model.forward`).
    """
    try:
        from meshrun.debug.explain import explain_exception
    except ImportError:
        return None
    return explain_exception(exc)


def _write_error_file(exc: BaseException, tb, formatted: str, hint: str | None = None) -> None:
    """torchelastic's error.json format, plus a `meshrun` block with exact time and call site."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json

    from meshrun.debug.readable import is_user_file, strip_cpp

    frames = _frames(tb)
    user = [f for f in frames if is_user_file(f[0])]
    site = (user or frames or [("<unknown>", 0, "<module>")])[-1]
    raised = (frames or [site])[-1]
    now = time.time()
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": formatted, "timestamp": str(int(now))},
        },
        "meshrun": {
            "time": now,
            "type": type(exc).__name__,
            "text": strip_cpp(str(exc)),  # the full message, C++ stack included, is in py_callstack
            "file": site[0],
            "line": site[1],
            "function": site[2],
            "raised_file": raised[0],
            "raised_line": raised[1],
            "rank": os.environ.get("RANK"),
            "pid": os.getpid(),  # the agent reports only its first failure's pid; this names the others
            "hint": hint,
        },
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    try:  # whole or not at all: the agent never reads a half-written file (a full disk)
        with open(tmp, "w") as fp:
            json.dump(data, fp)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _mark_runtime_failed() -> None:
    session = sys.modules.get("meshrun.runtime.session")
    if session is not None:
        session.mark_failed()


def _wait_for_hang_report() -> bool:
    """While the hang watchdog reports (it then exits the process), let the main thread add nothing."""
    process = sys.modules.get("meshrun.runtime.process")
    runtime = process.peek() if process is not None else None
    if runtime is None or not runtime.heartbeat.hang_reported.is_set():
        return False
    time.sleep(30)  # the watchdog ends the process within its grace period; this is only a bound
    return True


def _die_with_agent() -> None:
    """Linux: a SIGKILLed agent cannot stop its workers, so have the kernel do it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 9)  # SIGKILL
        if os.getppid() == 1:  # the agent died before prctl took effect
            os._exit(1)
    except (OSError, AttributeError):
        pass


class _DebugWhenTorchImports:
    """A meta path finder that installs meshrun.debug's hooks when the script first imports torch.

    The hooks only act on torch (its collectives and optimizers); importing them costs tens of
    milliseconds that a script's first line need not wait for, and a script without torch never pays.
    """

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 - finder protocol
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        from meshrun.debug.hooks import install_import_hook
        from meshrun.runtime import process

        install_import_hook(process.get())  # puts its own finder, which wraps torch's import, first on sys.meta_path
        import importlib.util

        return importlib.util.find_spec(name)


def _hold_rank0_store() -> None:
    """Rank 0 of a script that calls init_process_group itself: its store on MASTER_ADDR only.

    torch's env:// store listens on every interface; meshrun holds a server on MASTER_ADDR's own
    address (127.0.0.1 on one node) right after the script imports torch, and torch's store reuses
    it (meshrun.runtime.store). A script using meshrun.init() gets the same from there.
    """
    if os.environ.get("RANK") != "0" or not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        return
    from meshrun.debug.after_import import after_torch_import

    def hold() -> None:
        from meshrun.runtime.store import hold_rank0_store

        hold_rank0_store()

    after_torch_import(hold)


def _install_debug() -> None:
    """Hang watchdog and --debug collectives (meshrun.debug), only when the launcher asked."""
    if os.environ.get("MESHRUN_HANG_TIMEOUT", "0") not in ("0", ""):
        import signal

        # A peer's watchdog can ask for this rank's stacks even before it imports torch
        # (meshrun.debug.stacks.STACK_SIGNAL, not imported here: the first line waits for no meshrun module).
        faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True, chain=False)
    if os.environ.get("MESHRUN_DEBUG") or os.environ.get("MESHRUN_HANG_TIMEOUT", "0") not in ("0", ""):
        if "torch" in sys.modules:
            from meshrun.debug.hooks import install_import_hook
            from meshrun.runtime import process

            install_import_hook(process.get())
        else:
            sys.meta_path.insert(0, _DebugWhenTorchImports())


def _script_file(target: str) -> str:
    """What `python target` makes `__main__.__file__` (Python >= 3.9): absolute, joined to the
    working directory as given, not normalised or resolved (`/cwd/../x.py`, a symlink's own name).
    A script that changes directory can still find its files from `__file__`, and its frames
    (co_filename) still name a file that exists."""
    return target if os.path.isabs(target) else os.path.join(os.getcwd(), target)


def _script_kind(path: str) -> str:
    """How `python path` runs it: "source" (compiled from its text, .py or not), "compiled" (a .pyc)
    or "archive" (a zip application or a directory: its __main__.py, the archive first on sys.path)."""
    if path.endswith(".py") and os.path.isfile(path):
        return "source"
    if os.path.isdir(path):
        return "archive"
    if path.endswith(".pyc") or not os.path.isfile(path):
        return "compiled"  # a missing file: runpy's error, as before
    import importlib.util
    import zipfile

    with open(path, "rb") as fp:
        if fp.read(len(importlib.util.MAGIC_NUMBER)) == importlib.util.MAGIC_NUMBER:
            return "compiled"
    return "archive" if zipfile.is_zipfile(path) else "source"


def _main_globals() -> dict:
    """What the interpreter puts in its own `__main__` before the script runs (pylifecycle's
    add_main_module): `__builtins__` the builtins module, not its dict, and `__annotations__`
    before Python 3.14."""
    import builtins

    return {"__annotations__": {}, "__builtins__": builtins} if sys.version_info < (3, 14) \
        else {"__builtins__": builtins}


def _run_script(path: str) -> None:
    """`python path` for a source file: `__main__` as the interpreter makes it, not as runpy does.

    runpy.run_path gives `__file__` as given (relative), no `__loader__` and `__package__ == ""`;
    `python path`, which torchrun runs, gives an absolute `__file__`, a SourceFileLoader and
    `__package__` None. runpy and the pkgutil it imports also cost more than a script's own start-up.
    """
    import io
    import types

    try:  # the interpreter's own loader class (importlib.machinery's), already loaded: no import to wait for
        from _frozen_importlib_external import SourceFileLoader
    except ImportError:  # not CPython
        from importlib.machinery import SourceFileLoader

    filename = _script_file(path)
    with io.open_code(filename) as fp:
        code = compile(fp.read(), filename, "exec")
    module = types.ModuleType("__main__")
    module.__dict__.update(_main_globals(), __loader__=SourceFileLoader("__main__", filename),
                           __file__=filename, __cached__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module  # pickle and multiprocessing find the script's own __main__
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules["__main__"] = saved


def run(argv: list[str]) -> int:
    """Run `[-m] TARGET ARGS...` as `__main__`; return the process exit code."""
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        print("meshrun worker: no script or module given", file=sys.stderr)
        return 2
    target, args = argv[0], argv[1:]
    faulthandler.enable()  # a segfault or abort still leaves a Python stack in the rank's log
    _die_with_agent()
    _install_debug()
    _hold_rank0_store()
    try:
        sys.argv = [target, *args]  # as given, as `python target` leaves it (`-m`: runpy sets the file)
        if as_module:
            sys.path[0] = os.getcwd()
            import runpy

            runpy.run_module(target, _main_globals(), run_name="__main__", alter_sys=True)
        else:
            kind = _script_kind(target)
            # The script's own directory, symlinks resolved, as Python computes sys.path[0]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            if kind == "source":
                _run_script(target)
            else:  # rare: runpy, which sets sys.argv[0] to the absolute path while the target runs
                import runpy

                if kind == "archive":
                    del sys.path[0]  # run_path puts the archive itself there, as Python does
                runpy.run_path(_script_file(target), _main_globals(), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return 0
        _mark_runtime_failed()  # a failing rank skips the shutdown barrier
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 - every failure must be recorded
        import traceback

        from meshrun.debug.readable import format_exception, is_user_file, verbose

        _mark_runtime_failed()
        if _wait_for_hang_report():
            return 124  # meshrun.debug.watchdog.HANG_EXIT_CODE, should the watchdog not have exited
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C reached the whole group: the launcher says so once
            return 130
        tb = _user_traceback(exc)
        full = "".join(traceback.format_exception(type(exc), exc, tb))
        formatted = full if verbose() else format_exception(exc, tb)
        if getattr(exc, "meshrun_diagnosis", False):  # meshrun's own report: the user's frames only
            frames = [f for f in traceback.extract_tb(tb) if is_user_file(f.filename)]
            formatted = "".join(["Traceback (most recent call last):\n", *traceback.format_list(frames),
                                 f"{type(exc).__name__}: {exc}\n"])
        sys.stderr.write(formatted)
        hint = _explain(exc)
        if hint:
            sys.stderr.write(f"meshrun: {hint}\n")
        _write_error_file(exc, tb, full, hint)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
