"""Which workers fork from the pre-imported server (launch/preload.py), and how torch's agent is told.

The forked workers themselves run in tests/e2e/test_snapshot_resume.py (every start checked
single-threaded) and in every `meshrun train` test.
"""

from __future__ import annotations

import sys

import pytest

from meshrun.launch.args import build_parser
from meshrun.launch.launcher import WORKER_MAIN, build_launch
from meshrun.launch.preload import PRELOAD_MODULES, PRELOADED_TARGETS, preloaded_main
from meshrun.launch.spec import launch_spec

TRAIN = ["--nproc-per-node", "2", "-m", "meshrun.train.worker", "--run-dir", "r"]


def _plan(argv: list[str], environ: dict[str, str] | None = None):
    return launch_spec(build_parser().parse_args(argv), {"PATH": "/usr/bin", **(environ or {})})


def test_meshrun_train_workers_are_forked_from_the_preloaded_server(tmp_path):
    plan = _plan(TRAIN)
    assert plan.preload
    config, entry, args = build_launch(plan, str(tmp_path))
    assert entry is preloaded_main and config.start_method == "forkserver"
    assert args == ["-m", "meshrun.train.worker", "--run-dir", "r"]  # worker_main.run's argv; no -u
    assert "torch" in PRELOAD_MODULES and "meshrun.train.trainer" in PRELOAD_MODULES


def test_every_preloaded_name_is_a_module():
    """multiprocessing's forkserver skips a preload name that does not import, without a word:
    a renamed module would only make every restart slower. The names are strings, so check them."""
    import importlib.util

    from meshrun.testing.harness import PRELOAD

    missing = [name for name in (*PRELOAD_MODULES, *PRELOADED_TARGETS, *PRELOAD) if importlib.util.find_spec(name) is None]
    assert not missing, f"preloaded names that are not modules: {missing}"


@pytest.mark.parametrize("argv, environ", [
    (["--nproc-per-node", "2", "train.py"], {}),  # a user's script: its imports are its own
    (["--nproc-per-node", "2", "-m", "pkg.train"], {}),
    (TRAIN, {"OMP_NUM_THREADS": "4"}),  # torch's import would start OpenMP threads in the server
    (["--nproc-per-node", "1", *TRAIN[2:]], {}),  # one process: OMP_NUM_THREADS is not set to 1
    (TRAIN, {"MESHRUN_PRELOAD": "0"}),
])
def test_other_workers_are_started_as_before(tmp_path, argv, environ):
    plan = _plan(argv, environ)
    assert not plan.preload
    config, entry, args = build_launch(plan, str(tmp_path))
    assert isinstance(entry, str) and args[:2] == ["-u", WORKER_MAIN] and config.start_method != "forkserver"


SERVER_PROBE = r"""
import os, sys, tempfile, threading, multiprocessing
from meshrun.launch.preload import start_server
from multiprocessing import forkserver

held = tempfile.TemporaryFile()  # a descriptor of this process's own: the server must not keep it
if sys.argv[1] == "thread":
    gate = threading.Event()
    threading.Thread(target=gate.wait, daemon=True).start()
forked = start_server({"PROBE_VAR": "from-the-job"})
ctx = multiprocessing.get_context("forkserver")
child = ctx.Process(target=exec, args=(
    "import os; print('CHILD', os.environ.get('PROBE_VAR'), os.getppid(), "
    "len(os.listdir(f'/proc/{os.getppid()}/task')), flush=True)",))
child.start()
child.join(60)
server = forkserver._forkserver._forkserver_pid
def _link(fd):  # an fd the server closes between the listing and the read (seen once in a suite run)
    try:
        return os.readlink(f"/proc/{server}/fd/{fd}")
    except FileNotFoundError:
        return None
fds = [_link(fd) for fd in os.listdir(f"/proc/{server}/fd")]
own = os.readlink(f"/proc/self/fd/{held.fileno()}")
print("SERVER", forked, server, child.exitcode, own in fds, "torch" in sys.modules, flush=True)
"""


def _probe(mode: str) -> tuple[list[str], list[str]]:
    from conftest import run_proc

    result = run_proc([sys.executable, "-c", SERVER_PROBE, mode], timeout=120)
    assert result.returncode == 0, result.output
    lines = result.stdout.split("\n")
    child = next(line.split() for line in lines if line.startswith("CHILD"))
    server = next(line.split() for line in lines if line.startswith("SERVER"))
    return child, server


def test_the_server_is_forked_from_the_launcher_with_the_jobs_environment():
    """A single-threaded launcher forks the server: the workers' parent, one thread, the job's
    variables, and none of the launcher's own descriptors (a run directory's lock, say)."""
    child, server = _probe("plain")
    assert server[1] == "True", server  # forked here
    assert server[5] == "True", server  # with torch imported: what the server would import
    assert child[1] == "from-the-job" and child[2] == server[2], (child, server)  # job's env; its parent
    assert child[3] == "1", child  # the server has one thread
    assert server[3] == "0" and server[4] == "False", server  # the child ran; the lock fd is not held


def test_a_launcher_with_another_thread_leaves_the_server_to_python():
    """fork() in a process with two threads is unsafe: Python's own server starts instead, and the
    job's variables reach the workers through the agent, not through this call."""
    child, server = _probe("thread")
    assert server[1] == "False", server
    assert child[1] == "None" and child[2] == server[2] and child[3] == "1", (child, server)
    assert server[3] == "0" and server[4] == "False", server
