"""`meshrun launch` arguments: torchrun's flags, meshrun's defaults, and a plan that changes nothing."""

from __future__ import annotations

import os

import pytest

from meshrun.errors import LaunchError
from meshrun.launch.args import (
    build_parser,
    fixed_nnodes,
    parse_nnodes,
    resolve_nproc_per_node,
)
from meshrun.launch.launcher import WORKER_MAIN, build_launch
from meshrun.launch.spec import launch_spec
from meshrun.runtime.device import MAX_AUTO_CPU_PROCS, auto_nproc_per_node


def test_every_torchrun_flag_is_accepted():
    from torch.distributed.run import get_args_parser

    ours = {s for a in build_parser()._actions for s in a.option_strings}
    theirs = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert theirs <= ours


def test_auto_nproc_on_cpu_is_between_2_and_the_cap():
    assert 2 <= auto_nproc_per_node() <= MAX_AUTO_CPU_PROCS
    assert auto_nproc_per_node(import_torch=False) == auto_nproc_per_node()  # torch is imported: asked
    assert resolve_nproc_per_node("auto") == str(auto_nproc_per_node())
    with pytest.raises(LaunchError, match="--nproc-per-node 0"):
        resolve_nproc_per_node("0")


@pytest.mark.parametrize(("text", "nodes", "fixed"), [
    ("1", (1, 1), 1), ("2", (2, 2), 2), ("2:2", (2, 2), 2), ("1:4", (1, 4), None), (" 3 ", (3, 3), 3),
])
def test_nnodes_parsing(text, nodes, fixed):
    assert parse_nnodes(text) == nodes and fixed_nnodes(text) == fixed


@pytest.mark.parametrize("text", ["two", "0", "2:1", ":3", "1:", "1:2:3", "", "-1"])
def test_bad_nnodes_is_one_line_naming_the_flag(text):
    with pytest.raises(LaunchError, match=r"--nnodes=.* must be N or MIN:MAX"):
        parse_nnodes(text)


def test_single_node_gets_a_free_c10d_port_and_prefixed_tee(tmp_path):
    args = build_parser().parse_args(["--log-dir", str(tmp_path), "train.py", "--lr", "1"])
    config, cmd, cmd_args = build_launch(launch_spec(args), str(tmp_path))
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "localhost:0"
    assert config.min_nodes == config.max_nodes == 1 and config.nproc_per_node >= 2
    assert config.log_line_prefix_template == "[rank ${rank}] "
    assert cmd_args == ["-u", WORKER_MAIN, "train.py", "--lr", "1"]


def test_module_and_no_python_targets(tmp_path):
    args = build_parser().parse_args(["-m", "pkg.train", "x"])
    assert build_launch(launch_spec(args), str(tmp_path))[2] == ["-u", WORKER_MAIN, "-m", "pkg.train", "x"]
    args = build_parser().parse_args(["--no-python", "/bin/echo", "hi"])
    config, cmd, cmd_args = build_launch(launch_spec(args), str(tmp_path))
    assert (cmd, cmd_args) == ("/bin/echo", ["hi"])


def test_multi_node_keeps_the_users_rendezvous(tmp_path):
    args = build_parser().parse_args(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                                      "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "job1", "train.py"])
    config = build_launch(launch_spec(args), str(tmp_path))[0]
    assert (config.rdzv_endpoint, config.run_id, config.max_nodes) == ("10.0.0.1:29400", "job1", 2)


def test_bad_nnodes_is_a_clear_error():
    args = build_parser().parse_args(["--nnodes", "two", "train.py"])
    with pytest.raises(LaunchError, match="--nnodes"):
        launch_spec(args)


def test_planning_changes_neither_the_namespace_nor_the_environment(monkeypatch):
    for var in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "OMP_NUM_THREADS", "MESHRUN_HANG_TIMEOUT", "LOGLEVEL"):
        monkeypatch.delenv(var, raising=False)
    args = build_parser().parse_args(["--nproc-per-node", "2", "--hang-timeout", "400", "train.py"])
    before_args, before_env = vars(args).copy(), dict(os.environ)
    plan = launch_spec(args)
    assert vars(args) == before_args and dict(os.environ) == before_env
    # ... and everything it decided is in the plan instead
    assert plan.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and plan.env["OMP_NUM_THREADS"] == "1"
    assert plan.env["MESHRUN_HANG_TIMEOUT"] == "400"
    assert "join_timeout=800" in plan.options.rdzv_conf and args.rdzv_conf == ""
    assert plan.options.tee == "3" and plan.log_dir is None and plan.quiet_torch_logs


def test_the_users_environment_wins(monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    plan = launch_spec(build_parser().parse_args(["--nproc-per-node", "2", "train.py"]))
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plan.env and "OMP_NUM_THREADS" not in plan.env


def test_building_the_config_leaves_the_environment_as_it_was(monkeypatch, tmp_path):
    # torch's config_from_args sets OMP_NUM_THREADS in the calling process when it is unset.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = launch_spec(build_parser().parse_args(["--nproc-per-node", "2", "train.py"]))
    build_launch(plan, str(tmp_path))
    assert "OMP_NUM_THREADS" not in os.environ


def test_scoped_environ_restores_every_key(monkeypatch):
    from meshrun.launch.torch_elastic import scoped_environ

    monkeypatch.setenv("MESHRUN_T_KEEP", "old")
    monkeypatch.delenv("MESHRUN_T_NEW", raising=False)
    with pytest.raises(RuntimeError), scoped_environ({"MESHRUN_T_KEEP": "x", "MESHRUN_T_NEW": "y"}):
        assert os.environ["MESHRUN_T_KEEP"] == "x" and os.environ["MESHRUN_T_NEW"] == "y"
        raise RuntimeError("the agent failed")
    assert os.environ["MESHRUN_T_KEEP"] == "old" and "MESHRUN_T_NEW" not in os.environ


def test_with_run_gives_a_new_plan():
    plan = launch_spec(build_parser().parse_args(["--nproc-per-node", "2", "-m", "meshrun.train.worker"]))
    run = plan.with_run(log_dir="/tmp/x/logs", script_args=["--run-dir", "/tmp/x"])
    assert run.log_dir == "/tmp/x/logs" and run.options.training_script_args == ["--run-dir", "/tmp/x"]
    assert plan.log_dir is None and plan.options.training_script_args == []
