"""Pre-imported workers for `meshrun train`: each (re)start forks from a process that has imported torch.

A restarted worker of `meshrun train` used to pay `import torch` and meshrun's training modules
again, 3-4 s of a 5.7 s recovery on a loaded 2-core machine (docs/fault-tolerance.md). torch's
elastic agent can start workers as a Python callable with a multiprocessing start method
(`LaunchConfig.start_method`, torch/distributed/elastic/multiprocessing/api.py
`MultiprocessContext`); with "forkserver", Python's multiprocessing starts one server process that
imports the preload modules once (`multiprocessing.set_forkserver_preload`), and every worker of
every attempt is a fork of it. Only `meshrun train`'s worker target uses it (spec.py decides):
user scripts under `meshrun launch` keep torchrun's `python -u worker_main.py ...` path.

What a worker gets is what worker_main.py gives a Popen'd one (`worker_main.run`): error file,
PR_SET_PDEATHSIG (its parent is the forkserver, which exits when the launcher does, so a
SIGKILLed launcher still takes its workers with it), debug/hang hooks, exit codes, the failure
summary; torch's agent redirects and tees each rank's output with the same prefix.

Fork safety: fork() copies only the calling thread, so a lock another thread held at the fork
stays locked forever in the child. The forkserver is single-threaded by construction (it only
imports modules, whose import must start no thread: reading a module changes nothing (tests/unit/test_structure.py), and torch's import starts
none; OpenMP/intra-op pools start at the first parallel op, never in the forkserver). Each
worker checks it: it counts its parent's threads (/proc) and records the figure
(`forkserver_threads` in events.jsonl's `worker_start`); a parent with more than one thread gets
a warning line. The environment is the forkserver's, taken when it starts (inside the launch,
with the job's variables set), plus the agent's per-worker variables; the launch stops it at its
end (`stop_server`), so the next launch in the same process starts a new one.

The server is forked from the launcher itself where that is safe (`start_server`): the launcher
has imported torch for its checks, and a new interpreter would import it all again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Mapping

# What every restart would otherwise import again: what a worker imported before its first step
# (an audit hook on "import" in a forked worker), less what these import themselves.
PRELOAD_MODULES = (
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint.state_dict",
    "torch._dynamo",  # initialising a model on the meta device goes through torch._refs, which imports it
    "encodings.idna",
    "meshrun.launch.worker_main",
    "meshrun.launch.preload",
    "meshrun.config",
    "meshrun.rundir.runs",
    "meshrun.debug.hooks",
    "meshrun.debug.optim_check",
    "meshrun.debug.store",
    "meshrun.debug.watchdog",
    "meshrun.models.hf_config",
    "meshrun.runtime.events",
    "meshrun.runtime.session",
    "meshrun.train.profile",
    "meshrun.train.trainer",
)
PRELOADED_TARGETS = ("meshrun.train.worker", "meshrun.fault.worker")  # `-m` targets whose workers fork from the preloaded server
WORKER_NAME = b"meshrun-worker"  # the forked worker's /proc/PID/comm (its cmdline is the forkserver's)
START_METHOD = "forkserver"
SERVER_VAR = "MESHRUN_FORKSERVER"  # "launcher" in a server start_server forked; unset in Python's own


def preloads(module: bool, target: str, environ: Mapping[str, str]) -> bool:
    """Does a `[-m] target` worker start from the preloaded forkserver? MESHRUN_PRELOAD=0: never."""
    return module and target in PRELOADED_TARGETS and environ.get("MESHRUN_PRELOAD", "1") != "0"


def use_forkserver(config, cmd_args: list[str]) -> tuple[object, list]:
    """Switch a LaunchConfig to forked, pre-imported workers; (entrypoint, its args) for `elastic_launch`.

    cmd_args are torchrun's for the Popen path: ["-u", "-m", TARGET, ARGS...].
    """
    import multiprocessing

    # Process-wide, and read when the server starts: at the first worker start of this launch.
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(list(PRELOAD_MODULES))
    config.start_method = START_METHOD
    argv = list(cmd_args[1:] if cmd_args[:1] == ["-u"] else cmd_args)  # -u: preloaded_main unbuffers the streams
    return preloaded_main, argv


@contextlib.contextmanager
def one_thread_torch() -> Iterator[None]:
    """Around the launcher's first `import torch`: OMP_NUM_THREADS=1 unless the user set it.

    torch's import with the variable unset starts an OpenMP thread, and a process with two threads
    cannot safely fork the workers' server (start_server). This process (the launcher) computes
    nothing but its checks, on the meta device. The variable is removed again at the end of the
    block, so the job's workers get what the user set (none: torchrun's 1 for several processes,
    every core for one).
    """
    if "torch" in sys.modules or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def start_server(environ: Mapping[str, str]) -> bool:
    """Start this launch's forkserver as a fork of this process, which has imported torch already.

    The server Python would start is a new interpreter that imports PRELOAD_MODULES again: 2.3 s
    of CPU a launch here, when this process (the launcher, after `meshrun train`'s checks) holds
    most of them. Forked now, before the agent starts a thread, it costs only the imports this
    process lacks. It is then what Python's would be: multiprocessing's own `forkserver.main`, on
    a listener and an "alive" pipe made as `ForkServer.ensure_running` makes them, with the job's
    environment (`environ`, set only around the fork), no file descriptor but stdin, stdout,
    stderr and those two, and default signal handlers. The agent finds it running and uses it.

    Only where that is safe and known: Linux, this process single-threaded (/proc: a lock another
    thread held would stay held in every worker), no server running yet, and a multiprocessing
    whose server takes no authentication key (Python 3.11-3.13). Otherwise False: the agent
    starts Python's own server at the first worker start, as before.
    """
    import importlib
    import multiprocessing
    import socket
    from multiprocessing import connection, forkserver, resource_tracker

    server = forkserver._forkserver
    known = all(hasattr(server, name) for name in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid"))
    if not (sys.platform.startswith("linux") and known and not hasattr(server, "_forkserver_authkey")
            and server._forkserver_pid is None and own_threads() == 1):
        return False
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(list(PRELOAD_MODULES))  # the fallback's
    for name in PRELOAD_MODULES:
        with contextlib.suppress(ImportError):  # as the server itself does
            importlib.import_module(name)
    if own_threads() != 1:  # an import started one: not safe to fork
        return False
    resource_tracker.ensure_running()  # shared by the server's workers, as with Python's own server
    address = connection.arbitrary_address("AF_UNIX")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        from meshrun.launch.torch_elastic import scoped_environ

        with scoped_environ(environ):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _serve(listener.fileno(), alive_r)  # never returns
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


def _serve(listener_fd: int, alive_r: int) -> None:
    """The forked server: the state a new interpreter would have, then multiprocessing's loop."""
    code = 1
    try:
        low = 3  # close every descriptor but stdin, stdout, stderr, the listener and the pipe
        for fd in (*sorted({listener_fd, alive_r}), os.sysconf("SC_OPEN_MAX")):
            os.closerange(low, fd)
            low = fd + 1
        for sig in signal.valid_signals():
            if sig not in (signal.SIGINT, signal.SIGKILL, signal.SIGSTOP) and callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # what the workers get back (forkserver.main)
        # A SIGTERM sent to every process of the job (SLURM's scancel and preemption, proctrack
        # signals the whole step; `kill -TERM -PGID`) must not end the server first: its workers'
        # results come back through it, and the agent would take them for dead before they commit
        # their preemption checkpoint. It is ignored here and put back in each worker
        # (preloaded_main); the server ends when its clients have gone, or by SIGKILL (stop_server).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # ... and put back in each child at once, in fork itself: a SIGTERM the agent sends a worker
        # still starting (Ctrl-C or a stop right at start-up) must not be lost before preloaded_main
        os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
        os.environ[SERVER_VAR] = "launcher"  # each worker records where it was forked from
        from multiprocessing import forkserver

        forkserver.main(listener_fd, alive_r, [])  # returns (SystemExit) when every client has gone
        code = 0
    except SystemExit:
        code = 0
    finally:
        os._exit(code)


def own_threads() -> int:
    """Threads of this process (Linux /proc); 0 where it cannot be read (never safe to fork then)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def stop_server() -> None:
    """End this launch's forkserver and reap it (its workers have exited by now).

    Its memory goes back at once, its CPU time counts as this process's children's, and a later
    launch in the same process gets a server started with that launch's environment.
    multiprocessing has no public call for it; `_stop` is what its own tests use. The server is
    SIGKILLed first (by pid): its workers are gone and it holds nothing to flush, and a graceful
    exit would spend a second tearing down the torch it imported.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:  # nothing left to flush: spare it a second of interpreter teardown (torch loaded)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stop = getattr(server, "_stop", None)
    if stop is not None:
        stop()


def preloaded_main(*argv: str) -> None:
    """A forked worker's entry (torch's MultiprocessContext calls it in the child): worker_main's run.

    A return is the worker's result (torch collects it); a failure is an exit code, as for a
    Popen'd worker: the process exits with it.
    """
    import gc

    # What the forkserver imported is never garbage: the collector skips it from here on, so a
    # collection neither walks the whole inherited heap nor copies its pages (copy-on-write).
    gc.freeze()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (_serve); a worker does not
    os.setsid()  # a session of its own, as torch gives an exec'd worker: what it starts is found there (leftovers.py)
    _name_process()
    threads = parent_threads()
    os.environ["MESHRUN_FORKSERVER_THREADS"] = str(threads)  # recorded by the worker's first event
    _unbuffered_streams()
    if threads > 1:
        print(f"meshrun: the forkserver this worker was forked from has {threads} threads, not 1; "
              "a lock held by one of them at the fork would never be released here", file=sys.stderr)
    from meshrun.launch.worker_main import run

    code = run(list(argv))
    _run_exit_handlers()  # what interpreter exit does for a Popen'd worker; a forked child skips atexit
    if _stopped:
        # The agent stopped the job (SIGTERM/SIGINT): it waits for this process to exit, not for a
        # result. Returned, the worker would wait in torch's `_wrap` for a "result read" event that
        # torch sets only when every worker has returned, until the agent SIGKILLs it 30 s later.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise SystemExit(code)


_stopped = False


def stopped_by_agent() -> None:
    """The worker is ending because its agent stopped the job (a preemption checkpoint is committed):
    a forked worker then exits at once instead of handing back a result (preloaded_main)."""
    global _stopped
    _stopped = True


def parent_threads() -> int:
    """Threads of this process's parent (Linux /proc); 1 where it cannot be read."""
    try:
        return len(os.listdir(f"/proc/{os.getppid()}/task"))
    except OSError:
        return 1


def _name_process() -> None:
    """/proc/PID/comm = meshrun-worker, so tools (and tests) can tell a worker from its forkserver."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_NAME = 15
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, WORKER_NAME)
        except (OSError, AttributeError):
            pass


def _unbuffered_streams() -> None:
    """As `python -u`: every line reaches the rank's log (and the tee) when it is written."""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        try:
            stream.flush()
            setattr(sys, name, io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False),  # noqa: SIM115
                                                encoding=stream.encoding, errors=stream.errors,
                                                write_through=True))
        except (OSError, ValueError, AttributeError):
            pass


def _run_exit_handlers() -> None:
    import atexit

    atexit._run_exitfuncs()
