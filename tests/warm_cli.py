"""A warm `meshrun` for the tests: command lines run in processes forked from one server that has
imported torch and meshrun's CLI once, instead of each paying a new interpreter and `import torch`.

Why: the suite is CPU-bound on 2 cores, and about 2 CPU-s of every `meshrun` process it starts is
the interpreter and `import torch` (the rest of a short `meshrun train` is about 1.5). conftest's
`run_proc` sends a `meshrun ...` command line here when nothing in its environment could change
what an import does (ImportSensitive); anything else, and MESHRUN_TEST_WARM=0, runs the console
script as a new process, as before.

What a command gets is what the console script gives it: a process of its own (forked from the
server, then a new session, the requested working directory and environment, stdin /dev/null,
stdout and stderr to files the client reads afterwards), `sys.argv` and `__main__` as the console
script has them, `meshrun.cli.run()`, and an exit status the client reads as Popen would (a signal
is negative). The server's only thread runs the loop below; it imports what a `meshrun train`
launcher imports before it forks its workers' server (meshrun.launch.preload), so that fork is
safe and cheap, then freezes what it holds out of the garbage collector's reach (gc.freeze), so
that a command's collections skip it (quick_exit unfreezes it to flush every open file). The
client waits with a deadline and, past it, kills the command's whole tree by pid. The server exits within a second of the pytest process that started it.

A second mode, for commands a shell runs (the docs test): the client passes its own descriptors
0, 1 and 2 over the socket (SCM_RIGHTS) and the command gets them as its stdin, stdout and stderr,
so its output streams to the shell's pipe in order. `python -I -S warm_cli.py client SOCKET SCRIPT
ARGS...` is that client: standard library only (about 20 ms of CPU, not 2 s), it forwards the
signals a shell or a kill sends it to the command, and exits as the command did (a signal: the
same signal). The server refuses such a request ("cold") when its environment differs from the
server's own start environment in a variable that could change an import, or SCRIPT is not the
venv's `meshrun`; then, and when no server answers, the client execs SCRIPT itself.

Server: `python warm_cli.py SOCKET` (one per pytest process, started at its first warm command).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time

# An environment that differs from the server's in one of these may change what an import did
# (threads, logging, caches, the search path): such a command runs as a new process.
IMPORT_SENSITIVE = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "TORCH", "PYTORCH", "PYTHON", "LD_", "CUDA",
                    "NCCL", "GLOO", "MALLOC", "LC_", "LANG")
# These only where the server imported the module that reads them (it imports none of them today;
# tests set HF_HUB_OFFLINE for the whole session once they build a Hugging Face model).
SENSITIVE_IF_IMPORTED = {"HF_": "huggingface_hub", "TRANSFORMERS": "transformers", "TOKENIZERS": "tokenizers"}
# Under those prefixes, but read by torch only when called (os.getenv in the function that uses
# it, torch/distributed/elastic/rendezvous/dynamic_rendezvous.py), never at import: these do not
# make a command cold (the restart tests set it; meshrun's launch sets it too).
READ_AT_CALL = frozenset({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE"})


def import_sensitive_change(server_env: dict[str, str], env: dict[str, str],
                            imported: frozenset[str] = frozenset(SENSITIVE_IF_IMPORTED.values())) -> str | None:
    """The first variable, by name, that differs between the two environments and could change an
    import (`imported`: which of SENSITIVE_IF_IMPORTED's modules the server has imported)."""
    prefixes = IMPORT_SENSITIVE + tuple(p for p, module in SENSITIVE_IF_IMPORTED.items() if module in imported)
    for key in sorted(set(server_env) | set(env)):
        if key.startswith(prefixes) and key not in READ_AT_CALL and server_env.get(key) != env.get(key):
            return key
    return None


# --- the server ----------------------------------------------------------------------------------

def _serve(path: str) -> None:
    start_env = dict(os.environ)  # what an fd-mode request's environment is compared with
    parent = os.getppid()  # the pytest process: the loop ends when it does (PR_SET_PDEATHSIG would
    # fire when the *thread* that started this server ends: a test's thread may start it)
    sys.path[0] = os.path.dirname(sys.executable)  # as the console script has it: not tests/
    script = os.path.realpath(os.path.join(sys.path[0], "meshrun"))
    import importlib

    import meshrun.cli
    from meshrun.launch.preload import PRELOAD_MODULES

    for name in PRELOAD_MODULES:
        importlib.import_module(name)
    del meshrun
    import gc

    gc.freeze()  # what a command's collections skip (quick_exit unfreezes it to flush every open file)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", json.dumps(sorted(m for m in SENSITIVE_IF_IMPORTED.values() if m in sys.modules)), flush=True)
    waiting: dict[int, socket.socket] = {}  # pid -> its client's connection
    while True:
        ready, _, _ = select.select([listener, wake_r, *waiting.values()], [], [], 1.0)
        if os.getppid() != parent:
            return
        if wake_r in ready:
            os.read(wake_r, 512)
        for pid, conn in list(waiting.items()):
            if conn in ready and _gone(conn):  # its client left before it ended: stop its tree, as kill_tree would
                from meshrun.testing.processes import kill_tree

                kill_tree(pid)
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:  # the client left (it killed the tree past its deadline)
                    pass
                conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            try:
                request, fds = _read_request(conn)
            except (OSError, EOFError, ValueError):  # a client that left (or was killed) while sending
                conn.close()
                continue
            if request.get("mode") == "fds" and _refuse(request, fds, start_env, script):
                _close(fds)
                try:
                    conn.sendall(b"cold\n")
                except OSError:
                    pass
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _child(request, fds, [listener, conn, *waiting.values()], (wake_r, wake_w))
            _close(fds)  # the command holds them now (else the shell's pipe would stay open here)
            try:
                conn.sendall(f"{pid}\n".encode())
            except OSError:  # the client left: the loop sees its connection closed and stops the command
                pass
            waiting[pid] = conn


def _gone(conn: socket.socket) -> bool:
    try:
        return not conn.recv(1)
    except OSError:  # reset: a client killed with an answer unread
        return True


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request line and the descriptors sent with its first bytes (fd mode: the client's 0, 1, 2)."""
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    if not data:
        _close(fds)
        raise EOFError("client closed the connection")
    if not data.endswith(b"\n"):
        try:
            data += _read_line(conn).encode()
        except BaseException:
            _close(fds)
            raise
    return json.loads(data), fds


def _refuse(request: dict, fds: list[int], start_env: dict[str, str], script: str) -> bool:
    """An fd-mode request runs cold unless it brought three descriptors, names the venv's `meshrun`
    and its environment could not change an import this server did (the client's own check in file mode)."""
    imported = frozenset(m for m in SENSITIVE_IF_IMPORTED.values() if m in sys.modules)
    return (len(fds) != 3 or os.path.realpath(request["argv"][0]) != script
            or import_sensitive_change(start_env, request["env"], imported) is not None)


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError("client closed the connection")
        data += chunk
    return data.decode()


def _child(request: dict, fds: list[int], sockets: list[socket.socket], pipe: tuple[int, int]) -> None:
    """In the forked process: become the console script's process, run the command, exit with its code."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for signum in request.get("ignored", []):  # as a shell leaves them (`cmd &`: SIGINT, SIGQUIT), inherited
            signal.signal(signum, signal.SIG_IGN)
        if "umask" in request:
            os.umask(request["umask"])
        for s in sockets:
            s.close()
        for fd in pipe:
            os.close(fd)
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import tempfile
        import types

        tempfile.tempdir = None  # TMPDIR is read again
        if request.get("mode") == "fds":  # the client's own stdin, stdout and stderr
            std = fds
        else:
            std = [os.open(os.devnull, os.O_RDONLY),
                   os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                   os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)]
        for target, fd in enumerate(std):
            os.dup2(fd, target)
        _close(std)
        # as a new interpreter sets up this stdout (-u / PYTHONUNBUFFERED: written through, no line buffering)
        sys.stdout.reconfigure(line_buffering=os.isatty(1) and not sys.stdout.write_through)
        script = request["argv"][0]
        main = types.ModuleType("__main__")
        main.__file__ = script  # what multiprocessing's spawn would re-import, as for the console script
        sys.modules["__main__"] = main
        sys.argv = list(request["argv"])
        from meshrun.cli import run

        run()  # exits (quick_exit) or raises SystemExit
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


# --- the client (in the pytest process) --------------------------------------------------------

class WarmServer:
    """One server per pytest process, started at its first command."""

    def __init__(self, env: dict[str, str], workdir) -> None:  # workdir: a pathlib.Path (not imported here: the client)
        import subprocess

        self.env = dict(env)
        self.path = str(workdir / "warm.sock")
        self.workdir = workdir
        self.ready = False
        with open(workdir / "warm.err", "wb") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, self.path], env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=err, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> None:
        """Started in the background (conftest starts it once a session will need it): wait for its imports."""
        if self.ready:
            return
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        word, _, loaded = line.decode().strip().partition(" ")
        if word != "ready":
            self.stop()
            raise RuntimeError(f"the warm meshrun server did not start: {(self.workdir / 'warm.err').read_text()[-2000:]}")
        self.imported = frozenset(json.loads(loaded))
        self.ready = True

    def run(self, argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str,
            timeout: float) -> tuple[int | None, int]:
        """(exit code, pid); exit code None past `timeout` (the caller kills the tree by pid)."""
        self.wait_ready()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        try:
            conn.sendall((json.dumps({"argv": argv, "env": env, "cwd": cwd, "stdout": stdout,
                                      "stderr": stderr}) + "\n").encode())
            deadline = time.monotonic() + timeout
            conn.settimeout(60)
            data = b""
            pid = None
            while True:
                if b"\n" in data:
                    line, _, data = data.partition(b"\n")
                    if pid is None:
                        pid = int(line)
                        continue
                    return int(line), pid
                left = deadline - time.monotonic()
                if pid is not None and left <= 0:
                    return None, pid
                conn.settimeout(max(left, 0.01) if pid is not None else 60)
                try:
                    chunk = conn.recv(4096)
                except TimeoutError:
                    if pid is None:
                        raise RuntimeError("the warm meshrun server did not answer") from None
                    continue
                if not chunk:
                    raise RuntimeError(f"the warm meshrun server closed the connection (pid {pid})")
                data += chunk
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# --- the thin client (a shell's `meshrun`: standard library only) ------------------------------

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def client(path: str, script: str, args: list[str]) -> None:
    """Run `script args...` in the server at `path` on this process's descriptors 0, 1, 2 and exit as
    it exits; where the server refuses or cannot be reached (or `path` is empty), exec `script`."""
    argv = [script, *args]
    ignored = [s for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]
    state: dict = {"pid": None, "pending": []}

    def forward(signum: int, _frame) -> None:
        if state["pid"] is None:
            state["pending"].append(signum)
            return
        try:
            os.kill(state["pid"], signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        if signum not in ignored:
            signal.signal(signum, forward)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        umask = os.umask(0)
        os.umask(umask)
        line = (json.dumps({"mode": "fds", "argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                            "ignored": ignored, "umask": umask}) + "\n").encode()
        sent = socket.send_fds(conn, [line], [0, 1, 2])
        conn.sendall(line[sent:])
        reader = conn.makefile("rb")
        answer = reader.readline().strip()
    except (OSError, ValueError):  # no server (or no path), a closed descriptor, a cwd removed
        answer = b""
    if not answer.isdigit():  # "cold", or nothing: the console script itself, with this argv
        for signum in (*FORWARDED, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
        for signum in state["pending"]:  # a signal before anything ran ends this process as it would have
            os.kill(os.getpid(), signum)
        os.execv(script, argv)
    state["pid"] = int(answer)
    for signum in state["pending"]:
        forward(signum, None)
    try:
        line = reader.readline()
    except OSError:
        line = b""
    if not line.strip():
        os.write(2, f"meshrun (warm client): the server left before pid {state['pid']} ended\n".encode())
        os._exit(1)
    code = int(line)
    if code < 0:  # killed by a signal: the same end here, as the shell would see the console script's
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "client":
        client(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        _serve(sys.argv[1])
