"""Child side of `run_distributed`: one rank's life, from start to exit, reported over a pipe.

Messages sent to the parent, in order: ``("armed",)`` once stack dumps are armed,
``("running",)`` as fn is called, then ``("result", data)`` with the pickled return value;
or, from any point on, ``("error", info)`` when anything raised.
Standard library only at import; torch comes in with meshrun.init() or with fn's module.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import IO, Any

# The signal the parent sends to a hung rank to get its Python stacks before killing it.
STACK_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_stack_file: IO[str] | None = None  # kept open: faulthandler writes to its fd from a signal handler


def run_rank(
    rank: int,
    payload: bytes,
    conn: Connection,
    init: bool,
    backend: str | None,
    stack_path: str,
    parent_pid: int,
    environ: dict[str, str] | None = None,
) -> None:
    """Run ``fn(*args, **kwargs)`` from ``payload`` as one rank; never returns: exit 0 after a
    result (_exit_done), exit 1 right after a failure. `environ`: the rank's whole environment,
    for a rank forked from a server that started with another one."""
    _exit_with_parent(parent_pid)
    if environ is not None:
        _take_environ(environ)
    faulthandler.enable()  # a segfault or abort still prints this rank's Python stack to stderr
    _arm_stack_dump(stack_path)
    conn.send(("armed",))
    try:
        fn, args, kwargs = pickle.loads(payload)
        if init:
            import meshrun

            meshrun.init(backend=backend)
        _native_stacks_on_crash()
        conn.send(("running",))
        value = fn(*args, **kwargs)
        try:
            data = pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"fn returned a value that cannot be pickled ({type(value).__name__}: {exc}); "
                "return plain data, e.g. tensor.tolist() or a dict of tensors"
            ) from exc
        conn.send(("result", data))
        if init:
            meshrun.shutdown()
        conn.close()
    except BaseException as exc:  # noqa: BLE001 - every failure, SystemExit included, is reported
        failed_at = time.time()
        _send_error(conn, exc, failed_at)
        # Exit at once, skipping the barrier in shutdown: peers blocked in a collective with this
        # rank see its sockets close and fail fast instead of waiting for the collective timeout.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _exit_done()


def _native_stacks_on_crash() -> None:
    """With torch loaded (by init or fn's module), a segfault or abort also prints every thread's
    C++ stack through torch's c10 handler, which then chains to faulthandler's Python stacks.
    faulthandler alone lists only Python threads, so a crash in a native one (gloo's workers)
    named no frame. torch's handler takes SIGUSR2 while on; the parent's stack dumps use SIGUSR1."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch._C._set_print_stack_traces_on_fatal_signal(True)


def _take_environ(environ: dict[str, str]) -> None:
    """Make `environ` this process's environment; torch's intra-op threads follow OMP_NUM_THREADS
    when torch came preloaded (its OpenMP read the variable when the server imported it)."""
    import gc

    gc.freeze()  # what the server imported is never garbage: collections skip it, pages stay shared
    os.environ.clear()
    os.environ.update(environ)
    torch = sys.modules.get("torch")
    threads = environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _exit_done() -> None:
    """Exit 0 as a forked process does: atexit handlers (logging's, multiprocessing's, fn's) and
    a flush, then os._exit, skipping the interpreter's teardown of every module, which costs
    about 0.6 s of CPU per rank once torch is imported (a quarter of a 2-rank run's CPU)."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _send_error(conn: Connection, exc: BaseException, failed_at: float) -> None:
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # start the traceback at the user's code, not at run_rank
    info: dict[str, Any] = {
        "time": failed_at,
        "type": _type_name(type(exc)),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
        "exception": None,
    }
    try:
        info["exception"] = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the text above is enough without it
        pass
    try:
        conn.send(("error", info))
    except OSError:
        pass  # the parent is gone; nothing left to tell


def _type_name(cls: type) -> str:
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _arm_stack_dump(path: str) -> None:
    """On STACK_DUMP_SIGNAL, write every thread's Python stack to `path` (works while blocked in C)."""
    global _stack_file
    if STACK_DUMP_SIGNAL is None:
        return
    _stack_file = open(path, "w")  # noqa: SIM115 - must outlive this function
    faulthandler.register(STACK_DUMP_SIGNAL, file=_stack_file, all_threads=True)


def _exit_with_parent(parent_pid: int) -> None:
    """Die with the parent (e.g. pytest killed), so no rank is left hung in a collective."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
        return

    def watch() -> None:  # elsewhere, poll: a thread that shows up in stack dumps
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="meshrun-parent-watch", daemon=True).start()
