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
safe and cheap. The client waits with a deadline and, past it, kills the command's whole tree by
pid. The server exits within a second of the pytest process that started it.

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
from pathlib import Path

# An environment that differs from the server's in one of these may change what an import did
# (threads, logging, caches, the search path): such a command runs as a new process.
IMPORT_SENSITIVE = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "TORCH", "PYTORCH", "PYTHON", "LD_", "CUDA",
                    "NCCL", "GLOO", "MALLOC", "LC_", "LANG")
# These only where the server imported the module that reads them (it imports none of them today;
# tests set HF_HUB_OFFLINE for the whole session once they build a Hugging Face model).
SENSITIVE_IF_IMPORTED = {"HF_": "huggingface_hub", "TRANSFORMERS": "transformers", "TOKENIZERS": "tokenizers"}


def import_sensitive_change(server_env: dict[str, str], env: dict[str, str],
                            imported: frozenset[str] = frozenset(SENSITIVE_IF_IMPORTED.values())) -> str | None:
    """The first variable, by name, that differs between the two environments and could change an
    import (`imported`: which of SENSITIVE_IF_IMPORTED's modules the server has imported)."""
    prefixes = IMPORT_SENSITIVE + tuple(p for p, module in SENSITIVE_IF_IMPORTED.items() if module in imported)
    for key in sorted(set(server_env) | set(env)):
        if key.startswith(prefixes) and server_env.get(key) != env.get(key):
            return key
    return None


# --- the server ----------------------------------------------------------------------------------

def _serve(path: str) -> None:
    parent = os.getppid()  # the pytest process: the loop ends when it does (PR_SET_PDEATHSIG would
    # fire when the *thread* that started this server ends: a test's thread may start it)
    sys.path[0] = str(Path(sys.executable).parent)  # as the console script has it: not tests/
    import importlib

    import meshrun.cli
    from meshrun.launch.preload import PRELOAD_MODULES

    for name in PRELOAD_MODULES:
        importlib.import_module(name)
    del meshrun
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
            if conn in ready and not conn.recv(1):  # its client left before it ended: stop its tree, as kill_tree would
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
            request = json.loads(_read_line(conn))
            pid = os.fork()
            if pid == 0:
                _child(request, [listener, conn, *waiting.values()], (wake_r, wake_w))
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError("client closed the connection")
        data += chunk
    return data.decode()


def _child(request: dict, sockets: list[socket.socket], pipe: tuple[int, int]) -> None:
    """In the forked process: become the console script's process, run the command, exit with its code."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
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

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
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


if __name__ == "__main__":
    _serve(sys.argv[1])
