"""Unit tests for `meshrun doctor`'s check functions, fed fake environments and machines."""

from __future__ import annotations

import socket
import subprocess
from types import SimpleNamespace

import pytest

from meshrun.cli.doctor import build_parser, format_table
from meshrun.doctor import FAIL, INFO, PASS, WARN, Check, run_checks, smoke, summarize
from meshrun.doctor.checks import (
    check_backends,
    check_devices,
    check_hostname,
    check_shm,
    check_torch,
    shm_usage,
)
from meshrun.doctor.env_checks import check_launch_env, check_nccl_env, check_omp

GiB = 1 << 30


def one_line(check: Check) -> None:
    assert "\n" not in check.detail and "\n" not in check.fix
    if check.status != PASS:
        assert check.fix, f"{check.name} is {check.status} without a fix"


# --- Check ---------------------------------------------------------------------------------


def test_check_flattens_multiline_text_and_rejects_unknown_status():
    check = Check("x", WARN, "a\n  b", "do\nthis")
    assert (check.detail, check.fix) == ("a b", "do this")
    with pytest.raises(AssertionError):
        Check("x", "OK", "")


# --- launch env ----------------------------------------------------------------------------


def test_launch_env_clean_passes():
    assert check_launch_env({"HOME": "/root"}).status == PASS


@pytest.mark.parametrize(
    "environ, needle",
    [
        ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
        ({"WORLD_SIZE": "abc"}, "unset WORLD_SIZE"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 must be < WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT=99999"),
        ({"MASTER_PORT": "abc"}, "unset MASTER_PORT"),
        ({"MASTER_PORT": "²"}, "unset MASTER_PORT"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR=''"),
    ],
)
def test_launch_env_malformed_fails_with_one_line_fix(environ, needle):
    check = check_launch_env(environ)
    assert check.status == FAIL
    assert needle in check.fix
    one_line(check)


def test_launch_env_complete_but_stale_warns():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    check = check_launch_env(environ)
    assert check.status == WARN
    assert "rank 1 of 2" in check.fix and "unset RANK" in check.fix
    one_line(check)


def test_launch_env_inside_a_launcher_and_partial_leftovers_are_info():
    inside = {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert check_launch_env(inside).status == INFO
    check = check_launch_env({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert check.status == INFO and "MASTER_PORT='29500'" in check.detail
    one_line(check)


# --- NCCL_* and OMP_NUM_THREADS ------------------------------------------------------------


@pytest.mark.parametrize(
    "environ, status",
    [
        ({}, PASS),
        ({"NCCL_P2P_DISABLE": "1"}, WARN),
        ({"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}, WARN),
        ({"NCCL_DEBUG": "INFO"}, WARN),
        ({"NCCL_P2P_DISABLE": "0"}, INFO),
        ({"NCCL_DEBUG": "WARN"}, INFO),
        ({"NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_BLOCKING_WAIT": "1"}, INFO),
    ],
)
def test_nccl_env(environ, status):
    check = check_nccl_env({"PATH": "/bin", **environ})
    assert check.status == status
    for name in environ:
        assert name in check.detail
    one_line(check)


def test_nccl_env_fix_names_only_the_dangerous_ones():
    check = check_nccl_env({"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"})
    assert check.fix.startswith("`unset NCCL_IB_DISABLE`")
    assert "NCCL_SOCKET_IFNAME" not in check.fix


@pytest.mark.parametrize(
    "environ, status",
    [({}, INFO), ({"OMP_NUM_THREADS": "1"}, PASS), ({"OMP_NUM_THREADS": "abc"}, WARN), ({"OMP_NUM_THREADS": "64"}, WARN)],
)
def test_omp(environ, status):
    check = check_omp(environ, num_cpus=2)
    assert check.status == status
    one_line(check)


# --- /dev/shm, hostname --------------------------------------------------------------------


def fake_statvfs(total: int, free: int, block: int = 4096):
    return lambda path: SimpleNamespace(f_blocks=total // block, f_bavail=free // block, f_frsize=block)


def missing(path):
    raise FileNotFoundError(path)


def test_shm_usage_reads_statvfs():
    assert shm_usage("/dev/shm", fake_statvfs(64 << 20, 60 << 20)) == (64 << 20, 60 << 20)
    assert shm_usage("/nope", missing) is None


def test_shm_docker_default_warns_with_the_fix():
    check = check_shm(shm_usage("/dev/shm", fake_statvfs(64 << 20, 64 << 20)))
    assert check.status == WARN and "64.0 MiB" in check.detail
    assert "--shm-size" in check.fix
    one_line(check)


def test_shm_large_passes_full_warns_missing_is_info():
    assert check_shm((8 * GiB, 8 * GiB)).status == PASS
    full = check_shm((8 * GiB, GiB // 10))
    assert full.status == WARN and "free" in full.detail
    assert check_shm(None).status == INFO


def test_hostname():
    assert check_hostname("node1", lambda host: "10.0.0.5").status == PASS
    trap = check_hostname("node1", lambda host: "127.0.1.1")
    assert trap.status == WARN and "127.0.1.1" in trap.detail and "node1" in trap.fix
    one_line(trap)

    def unresolvable(host):
        raise socket.gaierror(-2, "Name or service not known")

    broken = check_hostname("node1", unresolvable)
    assert broken.status == FAIL and "/etc/hosts" in broken.fix


# --- torch install (fake torch modules) ----------------------------------------------------


def fake_dist(*, available=True, gloo=True, nccl=False, mpi=False):
    return SimpleNamespace(
        is_available=lambda: available,
        is_gloo_available=lambda: gloo,
        is_nccl_available=lambda: nccl,
        is_mpi_available=lambda: mpi,
    )


def test_backends_no_nccl_on_cpu_is_info_but_warns_with_gpus():
    by_name = {c.name: c for c in check_backends(fake_dist(), num_gpus=0)}
    assert by_name["gloo"].status == PASS and by_name["nccl"].status == INFO and by_name["mpi"].status == INFO
    assert {c.name: c.status for c in check_backends(fake_dist(), num_gpus=2)}["nccl"] == WARN
    assert {c.name: c.status for c in check_backends(fake_dist(gloo=False), num_gpus=0)}["gloo"] == FAIL
    assert check_backends(fake_dist(available=False), num_gpus=0) == []


def fake_torch(*, cuda=None, accelerator=None, count=0):
    return SimpleNamespace(
        __version__="2.13.0",
        version=SimpleNamespace(cuda=cuda, hip=None, xpu=None),
        accelerator=SimpleNamespace(current_accelerator=lambda: accelerator, device_count=lambda: count),
    )


def test_torch_build_and_devices():
    assert "CUDA 12.6" in check_torch(fake_torch(cuda="12.6")).detail
    assert "CPU-only" in check_torch(fake_torch()).detail
    assert check_devices(fake_torch()).status == INFO
    assert check_devices(fake_torch(cuda="12.6")).status == WARN
    gpus = check_devices(fake_torch(cuda="12.6", accelerator=SimpleNamespace(type="cuda"), count=8))
    assert gpus.status == PASS and "8 x cuda" in gpus.detail


# --- smoke test plumbing -------------------------------------------------------------------


def test_choose_port_prefers_flag_then_valid_master_port():
    assert smoke.choose_port(1234, {"MASTER_PORT": "29500"}) == (1234, "--port")
    assert smoke.choose_port(None, {"MASTER_PORT": "29500"}) == (29500, "MASTER_PORT")
    for bad in ("abc", "0", "70000", "²"):
        port, source = smoke.choose_port(None, {"MASTER_PORT": bad})
        assert source == "free" and 0 < port < 65536


def test_worker_env_drops_stale_launcher_variables():
    stale = {"RANK": "7", "WORLD_SIZE": "abc", "LOCAL_RANK": "x", "MASTER_ADDR": "gone", "MASTER_PORT": "1",
             "TORCHELASTIC_RUN_ID": "old", "GROUP_RANK": "3", "KEEP_ME": "yes"}
    env = smoke.worker_env(stale, rank=1, port=4321)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "4321"
    assert env["OMP_NUM_THREADS"] == "1" and env["KEEP_ME"] == "yes"
    assert "TORCHELASTIC_RUN_ID" not in env and "GROUP_RANK" not in env


@pytest.fixture
def held_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_smoke_busy_port_fails_before_starting(held_port, monkeypatch):
    monkeypatch.setattr(smoke.subprocess, "Popen", None)  # must not start anything
    check = smoke.run_smoke(port=held_port, environ={})
    assert check.status == FAIL
    assert f"port {held_port} is already in use" in check.fix and "--port" in check.fix
    one_line(check)
    from_env = smoke.run_smoke(environ={"MASTER_PORT": str(held_port)})
    assert from_env.status == FAIL and "unset MASTER_PORT" in from_env.fix


@pytest.mark.timeout(60)  # bounded by the test's own timeout, not a wall-clock assertion
def test_smoke_timeout_kills_every_worker(monkeypatch):
    started: list[subprocess.Popen] = []

    class Recording(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(smoke.subprocess, "Popen", Recording)
    check = smoke.run_smoke(timeout=0.3, environ={})
    assert check.status == FAIL and "did not finish within 0.3 s" in check.detail and "--timeout" in check.fix
    assert len(started) == 2 and all(proc.returncode is not None for proc in started)


def test_smoke_retries_once_when_a_free_port_is_taken_meanwhile(monkeypatch):
    ports = []

    def fake_run_once(backend, port, source, timeout, environ):
        ports.append(port)
        if len(ports) == 1:
            return Check("smoke gloo", FAIL, f"rank 0 exited with code 1: port: {port}, name: EADDRINUSE", "x")
        return Check("smoke gloo", PASS, "ok")

    monkeypatch.setattr(smoke, "_run_once", fake_run_once)
    assert smoke.run_smoke(environ={}).status == PASS and len(ports) == 2
    ports.clear()
    assert smoke.run_smoke(port=40000, environ={}).status == FAIL and ports == [40000]  # a chosen port: no retry


def test_smoke_verdict_reports_failing_rank_error(tmp_path):
    outputs = []
    for text in ("", "Traceback (most recent call last):\nRuntimeError: Connection refused\n"):
        fp = (tmp_path / f"out{len(outputs)}").open("w+b")
        fp.write(text.encode())
        outputs.append(fp)
    procs = [SimpleNamespace(returncode=-9), SimpleNamespace(returncode=1)]
    check = smoke._verdict("smoke gloo", procs, outputs, 1234, 1.0)
    assert check.status == FAIL and "rank 0 exited with code -9" in check.detail
    procs = [SimpleNamespace(returncode=0), SimpleNamespace(returncode=1)]
    check = smoke._verdict("smoke gloo", procs, outputs, 1234, 1.0)
    assert "rank 1 exited with code 1: RuntimeError: Connection refused" in check.detail
    one_line(check)


# --- report --------------------------------------------------------------------------------


def test_summarize_and_table():
    report = [Check("a", PASS, "fine"), Check("b", WARN, "meh", "do b"), Check("c", FAIL, "bad", "do c")]
    summary = summarize(report)
    assert summary["ok"] is False and summary["failed_checks"] == ["c"]
    assert (summary["passed"], summary["warned"], summary["failed"], summary["info"]) == (1, 1, 1, 0)
    table = format_table(report, summary).splitlines()
    assert [line.strip() for line in table if "fix:" in line] == ["fix: do b", "fix: do c"]
    assert table[-1] == "verdict: NOT READY: 1 check failed (c)"
    assert summarize(report[:2])["ok"] is True


def test_static_checks_here_have_fixes_for_every_non_pass():
    report = run_checks(environ={"PATH": "/bin"}, skip_smoke=True)
    names = [check.name for check in report]
    assert names[:3] == ["torch", "devices", "distributed"] and names[-1] == "smoke gloo"
    for check in report:
        one_line(check)


def test_parser_rejects_bad_port_and_timeout():
    parser = build_parser()
    assert parser.parse_args([]).timeout == 60.0
    for bad in (["--port", "0"], ["--port", "x"], ["--timeout", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
