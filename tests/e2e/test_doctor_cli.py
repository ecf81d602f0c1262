"""`meshrun doctor` end to end: the real command, real worker processes, real sockets."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from conftest import child_env


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshrun", "doctor", *args],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=180,
    )


def lines_with(text: str, *needles: str) -> list[str]:
    return [line for line in text.splitlines() if all(needle in line for needle in needles)]


def status_of(stdout: str, name: str) -> str:
    rows = [line.split() for line in stdout.splitlines() if line.startswith(name + " ")]
    assert len(rows) == 1, stdout
    return rows[0][len(name.split())]


@pytest.fixture
def held_port():
    """A port with a listening socket on it, as a stale job or another service would hold it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_help_explains_checks_and_examples():
    result = doctor("--help")
    assert result.returncode == 0
    for needle in ("/dev/shm", "NCCL", "all_reduce", "--skip-smoke", "--port", "--timeout", "--json", "examples:"):
        assert needle in result.stdout


@pytest.mark.slow
def test_doctor_passes_here():
    result = doctor()
    assert result.returncode == 0, result.stdout + result.stderr
    assert status_of(result.stdout, "smoke gloo") == "PASS"
    assert "median" in lines_with(result.stdout, "smoke gloo")[0]
    assert result.stdout.rstrip().splitlines()[-1].startswith("verdict: READY")


@pytest.mark.slow
def test_json_lists_every_check_and_nothing_else():
    result = doctor("--json")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)  # the whole of stdout is one JSON document
    names = [check["name"] for check in data["checks"]]
    for name in ("torch", "devices", "distributed", "gloo", "nccl", "mpi", "hostname", "loopback",
                 "shm", "launch env", "nccl env", "omp threads", "smoke gloo"):
        assert name in names
    for check in data["checks"]:
        assert set(check) == {"name", "status", "detail", "fix"}
        assert check["status"] in ("PASS", "WARN", "FAIL", "INFO")
        assert check["status"] == "PASS" or check["fix"]
    assert data["summary"]["ok"] is True and data["summary"]["failed"] == 0


@pytest.mark.slow
def test_malformed_world_size_fails_but_smoke_workers_get_a_clean_env():
    result = doctor(WORLD_SIZE="abc", RANK="5", LOCAL_RANK="x")
    assert result.returncode == 1, result.stdout + result.stderr
    assert status_of(result.stdout, "launch env") == "FAIL"
    assert lines_with(result.stdout, "fix:", "WORLD_SIZE='abc' is not an integer", "unset WORLD_SIZE")
    assert status_of(result.stdout, "smoke gloo") == "PASS"  # the stale RANK/WORLD_SIZE never reached it
    assert "NOT READY" in result.stdout.splitlines()[-1] and "launch env" in result.stdout.splitlines()[-1]


def test_busy_port_from_flag_fails_with_the_fix_in_one_line(held_port):
    result = doctor("--port", str(held_port))
    assert result.returncode == 1, result.stdout + result.stderr
    assert status_of(result.stdout, "smoke gloo") == "FAIL"
    assert lines_with(result.stdout, "fix:", f"port {held_port} is already in use", "--port")


def test_busy_master_port_fails_with_the_fix_in_one_line(held_port):
    result = doctor("--json", MASTER_PORT=str(held_port))
    assert result.returncode == 1, result.stdout + result.stderr
    smoke = {check["name"]: check for check in json.loads(result.stdout)["checks"]}["smoke gloo"]
    assert smoke["status"] == "FAIL" and "MASTER_PORT" in smoke["detail"]
    assert f"port {held_port} is already in use" in smoke["fix"] and "unset MASTER_PORT" in smoke["fix"]
    assert "\n" not in smoke["fix"]
