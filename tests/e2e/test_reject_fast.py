"""Bad input to `meshrun train` / `meshrun launch` ends at once: one line, exit 2, nothing created.

Real processes: the console script, a held port, an unresolvable host. Each refusal must come
before torch is imported (checked in-process below) and within 5 s.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from conftest import child_env, meshrun

FAST_S = 5.0


@pytest.fixture(autouse=True)
def _new_interpreters(monkeypatch):
    """The 5 s include the interpreter's start, as a user's shell has it: no warm server (conftest)."""
    monkeypatch.setenv("MESHRUN_TEST_WARM", "0")


def _refused(result, started: float, *needles: str) -> str:
    took = time.monotonic() - started
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.output
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output and "C++" not in result.output and "c10::" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert took < FAST_S, f"refused after {took:.1f}s: {lines[0]}"
    return lines[0]


@pytest.mark.parametrize(("args", "named"), [
    (["--set", "train.run_dir=a-file"], "train.run_dir"),
    (["--set", "train.name=" + "x" * 300], "train.name"),
    (["--master-port", "99999"], "--master-port 99999"),
    (["--rdzv-endpoint", "host:abc", "--rdzv-backend", "c10d"], "--rdzv-endpoint"),
    (["--hang-timeout", "nan"], "--hang-timeout"),
    (["--log-dir", "a-file"], "--log-dir"),
    (["--set", "model.factory=os:system"], "model.factory"),
    (["--set", "model.dim=1000000000"], "model.dim=1000000000"),
    (["--steps", "20"], "did you mean `--set train.steps=20`?"),
])
def test_train_refuses_in_one_line_and_creates_nothing(tmp_path, args, named):
    (tmp_path / "a-file").write_text("not a directory")
    started = time.monotonic()
    result = meshrun("train", *args, cwd=tmp_path, timeout=60)
    _refused(result, started, named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no runs/, no logs


def test_a_refusal_does_not_import_torch(tmp_path):
    probe = ("import sys\nfrom meshrun.cli import main\n"
             "codes = [main(['train', *a]) for a in (['--set', 'train.seed=99999999999999999999'],"
             " ['--master-port', '0'], ['--set', 'model.dim=1000000000'], ['--tp', '2'])]\n"
             "print(codes, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == "[2, 2, 2, 2] False", done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []


def test_unresolvable_rendezvous_host_fails_fast(write_script):
    script = write_script("noop.py", "print('never runs')\n")
    started = time.monotonic()
    result = meshrun("launch", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", "HOST:29400", "--rdzv-id", "job1", str(script), timeout=60)
    _refused(result, started, "--rdzv-endpoint", "'HOST' does not resolve")


def test_several_nodes_without_an_endpoint_fail_fast(tmp_path, write_script):
    script = write_script("noop.py", "print('never runs')\n")
    started = time.monotonic()
    result = meshrun("launch", "--nnodes", "2", "--nproc-per-node", "1", str(script), timeout=60)
    _refused(result, started, "--nnodes 2 needs a rendezvous", "--rdzv-endpoint")
    started = time.monotonic()
    run = tmp_path / "run"
    run.mkdir()
    result = meshrun("train", "--nnodes", "2", cwd=run, timeout=60)
    _refused(result, started, "--nnodes 2")
    assert list(run.iterdir()) == []


def test_held_port_on_the_static_backend_fails_fast(tmp_path, write_script):
    script = write_script("noop.py", "print('never runs')\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        result = meshrun("launch", "--nproc-per-node", "1", "--rdzv-backend", "static",
                         "--rdzv-endpoint", f"127.0.0.1:{port}", str(script), timeout=60)
        _refused(result, started, "--rdzv-endpoint", f"port {port} is already in use")
        run = tmp_path / "run"
        run.mkdir()
        started = time.monotonic()
        result = meshrun("train", "--nproc-per-node", "2", "--master-port", str(port), cwd=run, timeout=60)
        _refused(result, started, "--master-port", f"port {port} is already in use")
        assert list(run.iterdir()) == []
