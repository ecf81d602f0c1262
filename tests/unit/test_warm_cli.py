"""The warm `meshrun` (tests/warm_cli.py) gives a command what a new process gives it, and is bounded.

conftest's run_proc sends `meshrun` command lines to a server that forked them from one
interpreter with torch imported; a command must not notice: the same output and exit code as
the console script in a new process, its own working directory and environment (tests/e2e set ports, run directories and
faults through it), and past its
deadline its whole tree is killed by pid. An environment that could change an import runs cold.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from conftest import _WARM_LOCK, TINY, _warm_server, child_env, meshrun

from meshrun.testing.processes import descendants

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

