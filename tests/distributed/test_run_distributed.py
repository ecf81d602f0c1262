"""run_distributed on real gloo processes: results, failure reports, timeouts, parity with one process."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import meshrun
from meshrun.launch.ports import QUIET_POOL, quiet_pool_usable
from meshrun.testing import (
    DistributedTestError,
    DistributedTimeoutError,
    NotPicklableError,
    RankExitedError,
    run_distributed,
)
from meshrun.testing.ports import PORT_RANGE_VAR, pick_port, worker_range

pytestmark = pytest.mark.timeout(120)

# Rank functions live at module level: spawned ranks import them by name.


def _probe(scale: float, *, tag: str) -> dict[str, Any]:
    t = torch.ones(1) * scale
    dist.all_reduce(t)
    env = meshrun.current()
    assert env is not None
    return {
        "rank": env.rank,
        "world_size": env.world_size,
        "sum": t.item(),
        "tag": tag,
        "torch_threads": torch.get_num_threads(),
        "vars": {
            name: os.environ.get(name)
            for name in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "OMP_NUM_THREADS",
                "MESHRUN_TEST_MARK",
            )
        },
    }


def _all_reduce_rank() -> tuple[int, float]:
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _raise_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("bad shard on rank 1")
    return 0


def _raise_before_collective() -> None:
    if dist.get_rank() == 1:
        time.sleep(0.5)  # let rank 0 enter the all_reduce first
        raise ValueError("rank 1 broke before the all_reduce")
    dist.all_reduce(torch.ones(1))  # fails only because rank 1 is gone


def _hang_on_rank_0(pid_dir: str) -> None:
    Path(pid_dir, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never calls it


def _exit_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))  # fails with a connection error once rank 1 is gone


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _segfault_in_a_thread(log: str) -> None:
    import ctypes
    import threading

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)  # this rank's stderr, where the crash handlers write
    crasher = threading.Thread(target=ctypes.string_at, args=(0,))  # reads address 0: SIGSEGV
    crasher.start()
    crasher.join()


def _plain_torch(marker_dir: str) -> tuple[float, bool]:
    # A rank that returned skips the interpreter's teardown, not fn's atexit handlers.
    atexit.register(Path(marker_dir, f"atexit{os.environ['RANK']}").write_text, "ran")
    dist.init_process_group("gloo")  # env:// from the variables run_distributed set
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item(), meshrun.current() is None


# DDP parity: 2 ranks on half a batch each must match one process on the whole batch.


def _make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _ddp_train() -> dict[str, torch.Tensor]:
    env = meshrun.current()
    assert env is not None
    model = DDP(_make_model())
    x, y = _batch()
    rows = slice(env.rank * 4, (env.rank + 1) * 4)  # equal halves: mean of means = full mean
    _train(model, x[rows], y[rows])
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


@pytest.fixture(scope="module")
def probe() -> list[dict[str, Any]]:
    """One 4-rank launch shared by the checks below (process starts are what these tests cost)."""
    return run_distributed(
        _probe,
        world_size=4,
        timeout=90,
        args=(2.0,),
        kwargs={"tag": "x"},
        env={"MESHRUN_TEST_MARK": "on"},
    )


def test_all_reduce_four_ranks_returns_values_in_rank_order(probe: list[dict[str, Any]]) -> None:
    assert [p["rank"] for p in probe] == [0, 1, 2, 3]
    assert [p["sum"] for p in probe] == [8.0] * 4
    assert all(p["world_size"] == 4 and p["tag"] == "x" for p in probe)


def test_children_get_launcher_env_and_one_omp_thread(probe: list[dict[str, Any]]) -> None:
    for rank, p in enumerate(probe):
        env = p["vars"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        if os.environ.get(PORT_RANGE_VAR):  # under pytest-xdist: this worker's own ports
            lo, hi = map(int, os.environ[PORT_RANGE_VAR].split("-"))
            assert lo <= int(env["MASTER_PORT"]) <= hi
        assert env["OMP_NUM_THREADS"] == "1" and p["torch_threads"] == 1
        assert env["MESHRUN_TEST_MARK"] == "on"
    assert "MESHRUN_TEST_MARK" not in os.environ  # the parent's environment is restored


def _env_and_threads() -> tuple[str | None, int, int]:
    return os.environ.get("MESHRUN_TEST_MARK"), torch.get_num_threads(), os.getppid()


def test_each_run_gets_the_environment_of_its_call(probe: list[dict[str, Any]], monkeypatch) -> None:
    """Ranks fork from a server started by an earlier run (the probe's), with that run's environment:
    a later call's variables and OMP_NUM_THREADS still reach its ranks, as spawn would give them."""
    monkeypatch.setenv("MESHRUN_TEST_MARK", "set after the server started")
    [(mark, threads, parent)] = run_distributed(_env_and_threads, world_size=1, timeout=60, init=False,
                                                env={"OMP_NUM_THREADS": "2"})
    assert mark == "set after the server started" and threads == 2
    [(mark, threads, _)] = run_distributed(_env_and_threads, world_size=1, timeout=60, init=False)
    assert mark == "set after the server started" and threads == 1
    if os.environ.get("MESHRUN_TEST_START", "forkserver") == "forkserver":
        assert parent != os.getpid()  # forked from the server, not from this process


def test_parallel_workers_pick_ports_from_disjoint_ranges(monkeypatch) -> None:
    ranges = [tuple(map(int, worker_range(i, 3).split("-"))) for i in range(3)]
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:], strict=False)) and ranges[-1][1] < 29400
    with socket.socket() as held, socket.socket() as neighbour:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        neighbour.bind(("127.0.0.1", port + 1))  # free now (an OSError here is a busy machine, not a bug)
        neighbour.close()
        monkeypatch.setenv(PORT_RANGE_VAR, f"{port}-{port + 1}")
        assert {pick_port() for _ in range(10)} == {port + 1}  # the held one is never picked
        monkeypatch.setenv(PORT_RANGE_VAR, f"{port}-{port}")
        with pytest.raises(OSError, match="no free port"):
            pick_port()
    monkeypatch.delenv(PORT_RANGE_VAR)
    if quiet_pool_usable():  # below the ephemeral range: no bind(0) or outgoing connection gets it
        assert all(QUIET_POOL[0] <= pick_port() <= QUIET_POOL[1] for _ in range(10))
    else:
        assert pick_port() >= 1024  # the OS's choice


def test_raising_rank_is_reported_with_rank_type_and_traceback() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_1, world_size=2, timeout=60)
    err = info.value
    assert str(err).startswith("rank 1 failed: ValueError: bad shard on rank 1")
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert isinstance(err.exception, ValueError)
    assert "in _raise_on_rank_1" in err.remote_traceback and "Traceback" in str(err)
    assert "run_rank" not in err.remote_traceback  # starts at the user's code


def test_follow_on_failures_are_not_reported_first() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_before_collective, world_size=2, timeout=60)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert str(info.value).startswith(
        "rank 1 failed: ValueError: rank 1 broke before the all_reduce"
    )


def _spawned_children() -> list[int]:
    """Live or zombie spawn children of this process, from /proc (psutil is not installed)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"\nPPid:\t{os.getpid()}\n" in status and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(90)  # a harness that ignores its timeout hangs here until this one fails the test
def test_hang_times_out_and_leaves_no_child_alive(tmp_path: Path) -> None:
    # How long past its timeout run_distributed takes to raise is benchmarks/failure_latency.py's figure.
    started = time.time()
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_hang_on_rank_0, world_size=2, timeout=6, args=(str(tmp_path),))
    err = info.value
    assert isinstance(err, TimeoutError) and err.timeout == 6 and 0 in err.ranks
    assert "timed out after 6s" in str(err) and "rank 0: " in str(err)
    pid0 = tmp_path / "rank0.pid"
    # rank 0 got into fn at least a second before the timeout (startup can eat 6 s under load; one
    # that got there as the timeout fired may be reported as still starting)
    if pid0.exists() and pid0.stat().st_mtime < started + 6 - 1:
        assert "rank 0: running fn" in str(err)
        assert "in _hang_on_rank_0" in err.stacks[0]  # where rank 0 was stuck
    for pid_file in tmp_path.glob("rank*.pid"):
        with pytest.raises(ProcessLookupError):  # gone and reaped, not a zombie
            os.kill(int(pid_file.read_text()), 0)
    assert multiprocessing.active_children() == []
    if Path("/proc/self/status").exists():
        assert _spawned_children() == []


def test_rank_exiting_without_exception_is_reported() -> None:
    with pytest.raises(RankExitedError) as info:
        run_distributed(_exit_on_rank_1, world_size=2, timeout=60)
    err = info.value
    assert str(err).startswith("rank 1 failed: exited with code 3 without raising an exception")
    assert err.rank == 1 and err.exitcode == 3 and err.signal_name is None


def test_rank_killed_by_signal_is_reported() -> None:
    with pytest.raises(RankExitedError) as info:
        run_distributed(_kill_self, world_size=1, timeout=60)
    err = info.value
    assert str(err).startswith("rank 0 failed: was killed by signal SIGKILL")
    assert err.exitcode == -signal.SIGKILL and err.signal_name == "SIGKILL"


def test_segfault_prints_every_threads_native_and_python_stack(tmp_path: Path) -> None:
    log = tmp_path / "rank0.err"
    with pytest.raises(RankExitedError) as info:
        run_distributed(_segfault_in_a_thread, args=(str(log),), world_size=1, timeout=60)
    assert info.value.signal_name == "SIGSEGV", info.value
    text = log.read_text()
    # torch's c10 handler: each thread's C++ frames, the crashing one through fatalSignalHandler
    assert "SIGSEGV(11), PID:" in text and "fatalSignalHandler" in text, text
    assert "Fatal Python error: Segmentation fault" in text and "string_at" in text, text  # faulthandler


def test_lambda_and_local_function_are_rejected_up_front() -> None:
    def local() -> int:
        return 1

    with pytest.raises(NotPicklableError, match="lambda.*module level"):
        run_distributed(lambda: 1, world_size=2)
    with pytest.raises(NotPicklableError, match="local function"):
        run_distributed(local, world_size=2)
    with pytest.raises(TypeError, match="picklable"):  # NotPicklableError is a TypeError too
        run_distributed(_all_reduce_rank, world_size=2, args=(lambda: 1,))
    assert multiprocessing.active_children() == []


def test_init_false_lets_fn_own_the_group_and_atexit_handlers_run(tmp_path: Path) -> None:
    results = run_distributed(_plain_torch, world_size=2, timeout=60, init=False, args=(str(tmp_path),))
    assert results == [(3.0, True)] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit0", "atexit1"]


def test_ddp_two_ranks_on_half_batches_match_one_process() -> None:
    per_rank = run_distributed(_ddp_train, world_size=2, timeout=60)
    reference = _make_model()
    _train(reference, *_batch())
    for name, expected in reference.state_dict().items():
        for state in per_rank:
            torch.testing.assert_close(state[name], expected, rtol=0, atol=1e-6)
