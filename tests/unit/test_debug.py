"""meshrun.debug in one process: settings and the timeout hierarchy, error explanations,
classification, failure attribution of watchdog aborts, and `diagnose` on written log trees."""

from __future__ import annotations

import argparse
import json
import re
import traceback

import pytest
from conftest import rank_log_dir

from meshrun.debug.explain import explain
from meshrun.debug.settings import (
    DebugSettings,
    TimeoutPlan,
    apply_launch_args,
    check_collective_timeout,
    parse_hang_timeout,
)
from meshrun.diagnose.classify import classify
from meshrun.diagnose.postmortem import diagnose, format_diagnosis
from meshrun.errors import LaunchError, MeshrunError
from meshrun.launch.summary import RankFailure, format_summary, is_follow_on, order_by_cause

# torch 2.13's own messages (torch/nn/parallel/distributed.py, torch/distributed/tensor/_dispatch.py)
DDP_CPU = ("DistributedDataParallel device_ids and output_device arguments only work with single-device/"
           "multiple-device GPU modules or CPU modules, but got device_ids [0], output_device None, and module "
           "parameters {device(type='cpu')}.")
DDP_MULTI = ("DistributedDataParallel device_ids and output_device arguments only work with single-device/"
             "multiple-device GPU modules or CPU modules, but got device_ids [0], output_device None, and module "
             "parameters {device(type='cuda', index=0), device(type='cuda', index=1)}.")
FSDP_FORWARD = "aten.addmm.default: got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor"


def test_timeout_hierarchy_derives_from_one_setting():
    plan = TimeoutPlan.from_hang_timeout(300)
    assert (plan.watchdog_s, plan.collective_s, plan.init_s, plan.rendezvous_s) == (300, 600, 600, 600)
    assert TimeoutPlan.from_hang_timeout(600).rendezvous_s == 1200
    assert TimeoutPlan.from_hang_timeout(400).rendezvous_s == 800  # never below init (2H), torch default 600
    off = TimeoutPlan.from_hang_timeout(0)
    assert off.watchdog_s == 0 and off.collective_s is None


@pytest.mark.parametrize("value", ["-1", "2", "abc"])
def test_bad_hang_timeouts_are_one_line(value):
    with pytest.raises(LaunchError, match=r"--hang-timeout") as info:
        parse_hang_timeout(value)
    assert "\n" not in str(info.value)


def test_inconsistent_timeouts_are_refused():
    with pytest.raises(LaunchError, match="not above --hang-timeout 300s"):
        check_collective_timeout(120, 300)
    check_collective_timeout(900, 300)
    args = argparse.Namespace(hang_timeout=300.0, rdzv_conf="join_timeout=60", debug=None)
    with pytest.raises(LaunchError, match="join_timeout=60 is below the init timeout 600s"):
        apply_launch_args(args)
    args = argparse.Namespace(hang_timeout=600.0, rdzv_conf="", debug="collectives")
    env = apply_launch_args(args)
    assert args.rdzv_conf == "join_timeout=1200"
    assert env["MESHRUN_HANG_TIMEOUT"] == "600" and env["MESHRUN_DEBUG"] == "collectives"
    assert env["MESHRUN_HANG_TIMEOUT_SET"] == "1"


def test_worker_settings_from_env():
    assert DebugSettings.from_env({}).hang_timeout_s == 0  # not under meshrun launch: no watchdog
    assert DebugSettings.from_env({"MESHRUN_HANG_TIMEOUT": "20"}).hang_timeout_s == 0  # no torchelastic either
    s = DebugSettings.from_env({"MESHRUN_HANG_TIMEOUT": "20", "MESHRUN_DEBUG": "collectives",
                                "MESHRUN_HANG_TIMEOUT_SET": "1", "TORCHELASTIC_RUN_ID": "x"})
    assert s.hang_timeout_s == 20 and s.collectives and s.explicit
    with pytest.raises(MeshrunError, match="MESHRUN_DEBUG"):
        DebugSettings.from_env({"MESHRUN_DEBUG": "everything"})


def test_explanations_give_the_right_call():
    assert "on CPU leave them out, DDP(model)" in explain("ValueError", DDP_CPU)
    assert "spans several devices" in explain("ValueError", DDP_MULTI)
    # the forward fix only where the frames show a direct forward call (tests/unit/test_debug_explain.py)
    direct = [traceback.FrameSummary("/u/train.py", 9, "<module>", lookup_line=False, line="y = model.forward(x)"),
              traceback.FrameSummary("/u/model.py", 4, "forward", lookup_line=False, line="return self.fc(x)")]
    assert "call model(x) instead" in explain("RuntimeError", FSDP_FORWARD, direct)
    assert "common causes" in explain("RuntimeError", FSDP_FORWARD)
    assert explain("ValueError", "bad batch") is None


@pytest.mark.parametrize("exc,text,log,signal,kind", [
    ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", "", None, "OOM"),
    ("CollectiveMismatchError", "collective mismatch: rank 1 diverged", "", None, "collective mismatch"),
    ("RuntimeError", "Detected mismatch between collectives on ranks. Rank 0 is running", "", None,
     "collective mismatch"),
    ("HangDetected", "hang watchdog: no rank made progress", "", None, "hang"),
    ("RendezvousTimeoutError", "", "", None, "rendezvous timeout"),
    ("DistNetworkError", "The server socket has failed to listen on any local network address. "
     "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE", "", None, "port conflict"),
    ("KeyError", "'labels'", "", None, "exception in user code"),
    (None, None, "", "SIGKILL", "killed by signal"),
    (None, None, "", "SIGSEGV", "native crash"),
    (None, None, "Fatal Python error: Segmentation fault\n\nThread 0x00007f22 (most recent call first):", None,
     "native crash"),
    (None, None, "terminate called without an active exception\nFatal Python error: Aborted", None, "native crash"),
    (None, None, "[rank1] killed by SIGTERM", None, "killed by signal"),
    (None, None, "meshrun: data warning: all 2 ranks read the identical first batch", None,
     "data duplication warning"),
])
def test_classification(exc, text, log, signal, kind):
    assert classify(exc, text, log, signal, follow_on=False).name == kind


def _failure(rank, exc, text, time):
    f = RankFailure(rank=rank, local_rank=rank, pid=100 + rank, exitcode=124, time=time, exc_type=exc, exc_text=text)
    f.follow_on = is_follow_on(f)
    return f


def test_watchdog_aborts_of_waiting_ranks_are_consequences():
    waiting = _failure(0, "HangDetected", "hang watchdog: ...; rank 0 is waiting in all_reduce #4 at t.py:9", 10.0)
    stalled = _failure(1, "HangDetected", "hang watchdog: ...; rank 1 is stalled in user code at t.py:5 in f", 11.0)
    ordered = order_by_cause([waiting, stalled])
    assert [f.rank for f in ordered] == [1, 0]
    text = format_summary(ordered, None)
    assert "Rank 1 failed first" in text and "as a consequence" in text


def test_diagnose_orders_root_cause_before_consequence(tmp_path):
    run = tmp_path / "runs" / "r1"
    logs = run / "logs"
    rank_log_dir(logs, 0, error={"time": 100.0, "type": "RuntimeError", "text": "[pair.cc:538] Connection reset by peer",
                              "file": "t.py", "line": 3, "function": "f", "rank": "0"})
    d1 = rank_log_dir(logs, 1, error={"time": 100.5, "type": "ValueError", "text": DDP_CPU, "file": "t.py",
                                   "line": 7, "function": "main", "rank": "1", "hint": explain("ValueError", DDP_CPU)})
    (logs / "failures.json").write_text(json.dumps({"failures": [
        {"rank": 1, "local_rank": 1, "exitcode": 1, "signal": None, "time": 100.5, "host": "nodeA",
         "log_dir": str(d1)}]}))
    diag = diagnose(str(run))
    text = format_diagnosis(diag)
    assert diag.first.rank == 1 and diag.first.kind == "exception in user code"
    assert "first failure: rank 1 (local rank 1 on nodeA)" in text
    assert "on CPU leave them out" in text and re.search(r"rank 0 \(consequence\)", text)
    assert [row["rank"] for row in diag.to_json()["timeline"]] == [0, 1]


def test_diagnose_refuses_a_directory_without_logs(tmp_path):
    with pytest.raises(MeshrunError, match="holds no rank logs"):
        diagnose(str(tmp_path))


def test_collective_timeout_follows_the_hierarchy():
    from datetime import timedelta

    from meshrun.debug.heartbeat import Heartbeat
    from meshrun.debug.hooks import DebugHooks

    hooks = DebugHooks(DebugSettings(300.0, frozenset(), explicit=True), Heartbeat())
    assert hooks.collective_timeout(None) == timedelta(seconds=600)
    with pytest.raises(LaunchError, match="not above --hang-timeout"):
        hooks.collective_timeout(timedelta(seconds=60))
    hooks = DebugHooks(DebugSettings(300.0, frozenset(), explicit=False), Heartbeat())
    assert hooks.collective_timeout(timedelta(seconds=60)) == timedelta(seconds=60)
    assert hooks.settings.hang_timeout_s == 30  # the default watchdog halves a shorter user timeout
    hooks = DebugHooks(DebugSettings(0.0, frozenset()), Heartbeat())
    assert hooks.collective_timeout(None) is None  # off: torch's own default
    assert not hooks.installed


def test_collective_wrappers_exist_only_between_install_and_shutdown():
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim import optimizer as opt

    from meshrun.debug.heartbeat import Heartbeat
    from meshrun.debug.hooks import DebugHooks

    def state():  # the optimizer hook counts last
        return (dist.all_reduce, c10d.all_reduce, dist.broadcast_object_list, c10d.barrier,
                funcol.all_gather_single, funcol.reduce_scatter_tensor, DistributedDataParallel.forward,
                len(opt._global_optimizer_pre_hooks), len(opt._global_optimizer_post_hooks))

    before = state()
    progress = Heartbeat()
    hooks = DebugHooks(DebugSettings(60.0, frozenset({"collectives"})), progress)
    hooks.install()
    during = state()
    # every collective wrapped, DTensor's functional ones and DDP's first forward (its bucket hook) too
    assert all(a is not b for a, b in zip(before[:-2], during[:-2], strict=True))
    assert during[-2:] == (before[-2] + 1, before[-1] + 1)  # the first-step check, the progress counter
    assert dist.all_reduce.__meshrun_wrapped__ is before[0]
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()
    assert progress.count == 1  # an optimizer step is progress
    hooks.shutdown()
    assert state() == before
    hooks.shutdown()  # twice is fine
    assert state() == before
    watchdog_only = DebugHooks(DebugSettings(60.0, frozenset()), Heartbeat())
    watchdog_only.install()  # records dist.* for the hang report; DDP and DTensor stay torch's own
    try:
        assert dist.all_reduce is not before[0]
        assert state()[4:7] == before[4:7]
    finally:
        watchdog_only.shutdown()
    assert state() == before


@pytest.mark.parametrize(("message", "kind"), [
    ("--master-port: port 29500 is in use by pid 7 (python); choose another", "port conflict"),
    ("--rdzv-endpoint 127.0.0.1:29400 is already used by another job (rdzv-id a); choose another port", "port conflict"),
    ("meshrun: rendezvous 'j' timed out: fewer than the minimum 2 node(s) (--nnodes 2) joined", "rendezvous timeout"),
    ("--rdzv-endpoint ':29400' has no host: is $MASTER_ADDR empty? set it to node 0's address", "bad launch options"),
])
def test_launcher_failures_are_classified(message, kind):
    from meshrun.diagnose.classify import classify_launch

    assert classify_launch(message).name == kind
