"""The warm `meshrun` (tests/warm_cli.py) gives a command what a new process gives it, and is bounded.

conftest's run_proc sends `meshrun` command lines to a server that forked them from one
interpreter with torch imported; a command must not notice: the same output and exit code as
the console script in a new process, its own working directory and environment (tests/e2e set ports, run directories and
faults through it), and past its
deadline its whole tree is killed by pid. An environment that could change an import runs cold.
The thin client (fd mode, the docs test's shells) gives the command its own stdin, stdout and
stderr, its signals and its fate, and execs the console script wherever the server cannot run it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import _WARM_LOCK, BIN, TINY, _warm_server, child_env, meshrun

from meshrun.launch.leftovers import running
from meshrun.testing.processes import descendants, kill_tree

pytestmark = pytest.mark.timeout(180)

COLD = {"MESHRUN_TEST_WARM": "0"}


@pytest.mark.parametrize("args", [
    ["config", "show", TINY],
    ["config", "show", TINY, "--set", "optim.lrr=1e-3"],  # a refusal: one line, exit 2
    ["train", TINY, "--set", "train.steps=0"],             # a refusal of train's own
])
def test_warm_and_cold_give_the_same_output_and_exit_code(tmp_path, args):
    warm = meshrun(*args, cwd=tmp_path)
    cold = meshrun(*args, cwd=tmp_path, env=COLD)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)


def test_a_command_runs_in_its_own_working_directory(tmp_path):
    (tmp_path / "cfg.toml").write_text('[train]\nname = "here"\n')
    got = meshrun("config", "show", "cfg.toml", cwd=tmp_path)
    assert got.returncode == 0 and re.search(r'^name +=\s*"here"', got.stdout, re.M), got.output


def test_an_import_sensitive_environment_runs_cold(monkeypatch):
    assert _warm_server(child_env()) is not None
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")  # this process's own environment moved:
    moved = _warm_server(child_env())                                # a new server, started with it
    assert moved is not None and moved.env["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/elsewhere"
    monkeypatch.undo()
    assert _warm_server(child_env({"OMP_NUM_THREADS": "3"})) is None
    assert _warm_server(child_env({"TORCH_LOGS": "+dynamo"})) is None
    # the server imports no Hugging Face module, so their variables change nothing (tests set them)
    assert _warm_server(child_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})) is not None
    # torch reads this one when the rendezvous runs, not at import: the restart tests run warm
    assert _warm_server(child_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})) is not None
    assert _warm_server(child_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_LOGS": "+dynamo"})) is None
    assert _warm_server(child_env(COLD)) is None


def test_past_its_deadline_the_whole_tree_is_killed_and_the_test_fails(tmp_path):
    server = _warm_server(child_env())
    with pytest.raises(pytest.fail.Exception, match="did not finish within 8s"):
        meshrun("train", TINY, "--set", "train.steps=100000", "--set", f"train.run_dir={tmp_path}", cwd=tmp_path, timeout=8)
    left = time.monotonic() + 10
    while descendants(server.proc.pid) and time.monotonic() < left:  # the server reaps what was killed
        time.sleep(0.05)
    assert not descendants(server.proc.pid), descendants(server.proc.pid)


def test_a_server_started_from_a_thread_outlives_the_thread():
    """A test's thread may start the server (test_launch's concurrent jobs): it must serve on after
    that thread ends (a parent-death signal would have killed it with the thread)."""
    from conftest import _stop_warm

    with _WARM_LOCK:
        _stop_warm()
    started = []
    thread = threading.Thread(target=lambda: started.append(_warm_server(child_env())))
    thread.start()
    thread.join()
    time.sleep(1.5)
    assert started[0].proc.poll() is None
    assert _warm_server(child_env()) is started[0]
    assert meshrun("config", "show", TINY).returncode == 0


# --- fd mode: the thin client a shell runs (the docs test's `meshrun`) ---------------------------

WARM_CLI = str(Path(__file__).resolve().parents[1] / "warm_cli.py")
MESHRUN = str(BIN / "meshrun")
STDIN_TOML = b'[train]\nname = "from-stdin"\n'


@pytest.fixture
def client(tmp_path):
    """client(SOCKET, ARGS...): `meshrun ARGS` as a shell block runs it through the warm server
    (docrun's prelude), in tmp_path; one still running at the end is killed (the server then stops its command)."""
    started: list[subprocess.Popen] = []

    def start(path: str, *args: str, env: dict[str, str | None] | None = None, **popen) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-I", "-S", WARM_CLI, "client", path, MESHRUN, *args],
                                        cwd=tmp_path, env=child_env(env), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True, **popen))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.communicate()


def _finish(proc: subprocess.Popen, stdin: bytes | None = None) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(stdin, timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        pytest.fail(f"{proc.args} did not finish within 60s")
    return proc.returncode, out.decode(), err.decode()


def _reaped_cpu_ticks(pid: int) -> int:
    """The CPU (clock ticks) of the children `pid` has reaped: grows when the server ran a command."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[13]) + int(fields[14])


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (SigCgt in /proc/PID/status)."""
    try:
        caught = re.search(r"^SigCgt:\s*([0-9a-f]+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return False
    return bool(caught and int(caught.group(1), 16) >> (signum - 1) & 1)


def _reading_stdin(proc: subprocess.Popen, server_pid: int) -> int:
    """The pid of the process running `meshrun config show /dev/stdin` for client `proc` once it has
    opened /dev/stdin: a descriptor on the client's stdin pipe besides its fd 0, in a process that
    catches SIGTERM (meshrun's handler is in place). The catch matters: a child just forked from the
    server holds the descriptors it received (SCM_RIGHTS) before it makes them 0, 1, 2 and starts
    the command, and a SIGTERM then kills it without the command's line."""
    pipe = os.readlink(f"/proc/{proc.pid}/fd/0") if proc.poll() is None else "?"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        for pid in [proc.pid, *descendants(server_pid)]:
            try:
                links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd") if int(fd) > 2]
            except OSError:
                continue
            if pipe in links and _catches(pid, signal.SIGTERM):
                return pid
        time.sleep(0.05)
    kill_tree(proc.pid)
    pytest.fail(f"no process read the client's stdin: {_finish(proc)}")


@pytest.mark.parametrize("args", [["--version"], ["config", "show", "nonexistent.toml"]])
def test_fd_mode_streams_to_the_clients_descriptors_as_the_console_script_does(tmp_path, client, args):
    server = _warm_server(child_env())
    before = _reaped_cpu_ticks(server.proc.pid)
    warm = _finish(client(server.path, *args))
    assert _reaped_cpu_ticks(server.proc.pid) > before, "the server ran no command: the client ran it cold"
    cold = _finish(subprocess.Popen([MESHRUN, *args], cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE))
    assert warm == cold and (cold[1] if args == ["--version"] else cold[2]), (warm, cold)


def test_the_command_reads_the_clients_stdin(client):
    server = _warm_server(child_env())
    proc = client(server.path, "config", "show", "/dev/stdin", stdin=subprocess.PIPE)
    pid = _reading_stdin(proc, server.proc.pid)
    assert pid != proc.pid and pid in descendants(server.proc.pid)  # warm: forked from the server
    code, out, err = _finish(proc, STDIN_TOML)
    assert code == 0 and re.search(r'^name +=\s*"from-stdin"', out, re.M), (code, out, err)


@pytest.mark.parametrize("why", ["import-sensitive environment", "no server"])
def test_the_client_execs_the_console_script_where_the_server_refuses_or_is_absent(tmp_path, client, why):
    server = _warm_server(child_env())
    path, env = (server.path, {"OMP_NUM_THREADS": "3"}) if why != "no server" else (str(tmp_path / "none.sock"), None)
    proc = client(path, "config", "show", "/dev/stdin", env=env, stdin=subprocess.PIPE)
    assert _reading_stdin(proc, server.proc.pid) == proc.pid  # the client became the console script
    assert MESHRUN in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
    code, out, err = _finish(proc, STDIN_TOML)
    assert code == 0 and re.search(r'^name +=\s*"from-stdin"', out, re.M), (code, out, err)


def test_sigterm_to_the_client_reaches_the_command(client):
    server = _warm_server(child_env())
    proc = client(server.path, "config", "show", "/dev/stdin", stdin=subprocess.PIPE)
    _reading_stdin(proc, server.proc.pid)
    os.kill(proc.pid, signal.SIGTERM)  # not forwarded: the client would die of it, without the command's line
    code, out, err = _finish(proc)
    assert (code, err) == (143, "meshrun config: stopped by SIGTERM\n"), (code, out, err)


def test_a_client_killed_with_sigkill_takes_the_command_with_it(client):
    server = _warm_server(child_env())
    proc = client(server.path, "config", "show", "/dev/stdin", stdin=subprocess.PIPE)
    pid = _reading_stdin(proc, server.proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 10  # its stdin is still open (ours): only the server can end it
    while (running(pid) or descendants(server.proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = descendants(server.proc.pid)
    _finish(proc)  # closes that stdin
    assert not left, left


def test_the_client_imports_only_the_standard_library(tmp_path):
    server = _warm_server(child_env())
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-X", "importtime", WARM_CLI, "client", server.path, MESHRUN,
                             "--version"], cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    code, out, err = _finish(proc)
    modules = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in err.splitlines() if line.startswith("import time:")}
    assert code == 0 and out.startswith("meshrun ") and "socket" in modules, (code, out, err)
    assert not modules & {"torch", "meshrun", "numpy", "pathlib"}, sorted(modules)
