"""`meshrun launch` arguments: torchrun's flags, meshrun's defaults."""

from __future__ import annotations

import pytest

from meshrun.errors import LaunchError
from meshrun.launch.args import MAX_AUTO_CPU_PROCS, auto_nproc_per_node, build_parser
from meshrun.launch.launcher import WORKER_MAIN, build_launch


def test_every_torchrun_flag_is_accepted():
    from torch.distributed.run import get_args_parser

    ours = {s for a in build_parser()._actions for s in a.option_strings}
    theirs = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert theirs <= ours


def test_auto_nproc_on_cpu_is_between_2_and_the_cap():
    assert 2 <= auto_nproc_per_node() <= MAX_AUTO_CPU_PROCS


def test_single_node_gets_a_free_c10d_port_and_prefixed_tee(tmp_path):
    args = build_parser().parse_args(["--log-dir", str(tmp_path), "train.py", "--lr", "1"])
    config, cmd, cmd_args = build_launch(args)
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "localhost:0"
    assert config.min_nodes == config.max_nodes == 1 and config.nproc_per_node >= 2
    assert config.log_line_prefix_template == "[rank ${rank}] "
    assert cmd_args == ["-u", WORKER_MAIN, "train.py", "--lr", "1"]


def test_module_and_no_python_targets(tmp_path):
    args = build_parser().parse_args(["--log-dir", str(tmp_path), "-m", "pkg.train", "x"])
    assert build_launch(args)[2] == ["-u", WORKER_MAIN, "-m", "pkg.train", "x"]
    args = build_parser().parse_args(["--log-dir", str(tmp_path), "--no-python", "/bin/echo", "hi"])
    config, cmd, cmd_args = build_launch(args)
    assert (cmd, cmd_args) == ("/bin/echo", ["hi"])


def test_multi_node_keeps_the_users_rendezvous(tmp_path):
    args = build_parser().parse_args(["--log-dir", str(tmp_path), "--nnodes", "2", "--nproc-per-node", "2",
                                      "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400",
                                      "--rdzv-id", "job1", "train.py"])
    config = build_launch(args)[0]
    assert (config.rdzv_endpoint, config.run_id, config.max_nodes) == ("10.0.0.1:29400", "job1", 2)


def test_bad_nnodes_is_a_clear_error(tmp_path):
    args = build_parser().parse_args(["--log-dir", str(tmp_path), "--nnodes", "two", "train.py"])
    with pytest.raises(LaunchError, match="--nnodes"):
        build_launch(args)
