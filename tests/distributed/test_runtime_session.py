"""meshrun.init()/shutdown() in real gloo groups: env, idempotence, world checks, teardown."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import meshrun
from meshrun.testing import DistributedTestError, run_distributed


def init_twice_and_describe():
    env = meshrun.init(timeout=30)
    assert meshrun.init() is env  # idempotent
    assert meshrun.current() is env
    x = torch.ones(2)
    dist.all_reduce(x)
    meshrun.shutdown()
    meshrun.shutdown()  # safe twice
    return (env.rank, env.local_rank, env.world_size, str(env.device), env.backend, env.device_ids,
            x.tolist(), dist.is_initialized())


def test_init_reads_the_launcher_env_and_shutdown_is_idempotent():
    results = run_distributed(init_twice_and_describe, world_size=2, timeout=90, init=False)
    assert results == [(r, r, 2, "cpu", "gloo", None, [2.0, 2.0], False) for r in range(2)]


def needs_three():
    meshrun.init(min_world_size=3)


def test_min_world_size_under_a_launcher_exits_with_the_command():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(needs_three, world_size=2, timeout=90, init=False)
    assert "SystemExit: 2" in str(info.value)


def adopt_user_group():
    dist.init_process_group("gloo")
    env = meshrun.init()
    meshrun.shutdown()  # not meshrun's group: left alone
    alive = dist.is_initialized()
    dist.destroy_process_group()
    return env.world_size, alive


def test_a_group_made_by_the_user_is_adopted_not_destroyed():
    assert run_distributed(adopt_user_group, world_size=2, timeout=90, init=False) == [(2, True)] * 2


def failing_rank_does_not_wait_for_peers():
    env = meshrun.init()
    if env.rank == 1:
        raise ValueError("rank 1 fails before the collective")
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    finally:
        meshrun.shutdown()
    return time.monotonic() - start


@pytest.mark.timeout(120)  # peers released: not the 30-minute gloo timeout, nor a barrier's wait
def test_failing_rank_is_reported_and_peers_are_released_quickly():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(failing_rank_does_not_wait_for_peers, world_size=2, timeout=90, init=False)
    assert info.value.rank == 1 and "rank 1 fails" in str(info.value)


def init_installs_and_shutdown_takes_back():
    import os
    import sys
    import threading

    import torch.distributed.distributed_c10d as c10d
    from torch.optim import optimizer as opt

    # What `meshrun launch --debug collectives --hang-timeout 60` sets for its workers.
    os.environ.update(MESHRUN_DEBUG="collectives", MESHRUN_HANG_TIMEOUT="60",
                      TORCHELASTIC_RUN_ID=os.environ.get("TORCHELASTIC_RUN_ID", "session-test"))

    def state():  # torch's init_process_group chains an excepthook of its own: look for meshrun's
        return [getattr(sys.excepthook, "__module__", "").startswith("meshrun"), dist.all_reduce, c10d.all_reduce, dist.broadcast, c10d.barrier,
                len(opt._global_optimizer_pre_hooks), len(opt._global_optimizer_post_hooks)]

    before = state()
    env = meshrun.init()
    during = state()
    x = torch.ones(1)
    dist.all_reduce(x)  # the first collective starts the watchdog
    watching = any(t.name == "meshrun-hang-watchdog" for t in threading.enumerate())
    meshrun.shutdown()
    after = state()
    deadline = time.monotonic() + 5
    while any(t.name == "meshrun-hang-watchdog" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    stopped = not any(t.name == "meshrun-hang-watchdog" for t in threading.enumerate())
    changed = [a != b for a, b in zip(before, during, strict=True)]  # functions compare by identity
    restored = [a == b for a, b in zip(before, after, strict=True)]
    return env.world_size, x.item(), changed, watching, restored, stopped, meshrun.current() is None


def test_init_installs_hooks_and_debug_wrappers_and_shutdown_takes_them_back():
    results = run_distributed(init_installs_and_shutdown_takes_back, world_size=2, timeout=90, init=False)
    assert results == [(2, 2.0, [True] * 7, True, [True] * 7, True, True)] * 2


PLAIN_PYTHON = """
import sys, meshrun
env = meshrun.init()
during = sys.excepthook.__module__
meshrun.shutdown()
after = getattr(sys.excepthook, "__module__", "")
print(during, after.startswith("meshrun"), meshrun.current() is None, env.world_size, env.rank)
"""


def test_plain_python_init_installs_its_excepthook_and_shutdown_removes_it(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "plain.py"
    script.write_text(PLAIN_PYTHON)
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # no launcher variables
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["meshrun.runtime.session", "False", "True", "1", "0"]
    (notice,) = done.stderr.strip().splitlines()
    assert "single process" in notice and "run: meshrun launch --nproc-per-node" in notice
    assert notice.endswith(str(script))
