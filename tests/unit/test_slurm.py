"""SLURM: compressed host lists, and the launch options derived from a faked SLURM_* environment."""

from __future__ import annotations

import pytest

from meshrun.cli.train import _launch_argv_from_config
from meshrun.config import load_config
from meshrun.errors import LaunchError
from meshrun.launch.args import build_parser
from meshrun.launch.slurm import SLURM_PORT_BASE, expand_hostlist, slurm_job, slurm_options
from meshrun.launch.spec import launch_spec

JOB = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
       "SLURM_JOB_NODELIST": "gpu[07-08,10],cpu3", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8"}


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2],b5,c[09-11]", ["a1", "a2", "b5", "c09", "c10", "c11"]),
    ("rack[1-2]-n[3-4]", ["rack1-n3", "rack1-n4", "rack2-n3", "rack2-n4"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("host-a.example.org,host-b", ["host-a.example.org", "host-b"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, fix", [("node[01-03", "unclosed"), ("node[a-b]", "cannot read range"),
                                       ("node[5-3]", "backwards")])
def test_bad_hostlist_is_one_clear_error(text, fix):
    with pytest.raises(LaunchError, match=fix):
        expand_hostlist(text)


def test_slurm_job_from_env():
    job = slurm_job(JOB)
    assert (job.job_id, job.num_nodes, job.node_id) == ("4242", 4, 2)
    assert job.hosts == ["gpu07", "gpu08", "gpu10", "cpu3"]
    assert job.endpoint == f"gpu07:{SLURM_PORT_BASE + 4242 % 2000}"


def test_step_nodelist_and_port_override_win():
    env = {**JOB, "SLURM_STEP_NODELIST": "gpu[08,10]", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1",
           "MESHRUN_RDZV_PORT": "31000"}
    job = slurm_job(env)
    assert job.endpoint == "gpu08:31000" and job.num_nodes == 2


def test_outside_slurm_or_switched_off():
    assert slurm_job({}) is None
    assert slurm_job({**JOB, "MESHRUN_SLURM": "0"}) is None


@pytest.mark.parametrize("env, fix", [
    ({"SLURM_JOB_ID": "1"}, "SLURM_JOB_NODELIST is not"),
    ({**JOB, "SLURM_NODEID": "9"}, "inconsistent"),
    ({**JOB, "SLURM_NNODES": "four"}, "not a number"),
    ({**JOB, "MESHRUN_RDZV_PORT": "70000"}, "not a TCP port"),
])
def test_inconsistent_slurm_env_is_one_clear_error(env, fix):
    with pytest.raises(LaunchError, match=fix):
        slurm_job(env)


def _parse(*argv: str):
    return build_parser().parse_args([*argv, "train.py"])


def test_launch_options_derived_from_slurm():
    args = _parse("--nproc-per-node", "2")
    job = slurm_job(JOB)
    assert job is not None
    options = slurm_options(args, job)
    assert options == {"nnodes": "4", "rdzv_backend": "c10d", "rdzv_id": "4242", "rdzv_endpoint": job.endpoint}
    assert (args.nnodes, args.rdzv_backend) == ("1:1", "static")  # the namespace itself is not changed


def test_launch_plan_takes_slurms_nodes_and_leaves_the_namespace_alone():
    args = _parse("--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:29400")  # no DNS lookup of gpu07
    before = vars(args).copy()
    plan = launch_spec(args, {**JOB, "PATH": "/usr/bin"})
    assert plan.slurm is not None and plan.slurm.node_id == 2
    assert (plan.nnodes, plan.options.rdzv_backend, plan.options.rdzv_id) == ("4", "c10d", "4242")
    assert plan.options.rdzv_endpoint == "127.0.0.1:29400"  # given on the command line: it wins
    assert vars(args) == before


def test_explicit_options_win_over_slurm():
    job = slurm_job(JOB)
    args = _parse("--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400", "--rdzv-id", "mine")
    assert slurm_options(args, job) == {"rdzv_backend": "c10d"}
    static = _parse("--master-addr", "10.0.0.1", "--master-port", "29500", "--nnodes", "2")
    assert slurm_options(static, job) == {}


def test_train_leaves_default_launch_keys_for_slurm_to_fill():
    argv = _launch_argv_from_config(load_config(None, []), [])
    assert "--nnodes" not in argv and "--rdzv-id" not in argv and "--rdzv-backend" not in argv
    argv = _launch_argv_from_config(load_config(None, ["launch.nnodes=2", "launch.rdzv_backend=c10d"]), [])
    assert argv[argv.index("--nnodes") + 1] == "2" and "c10d" in argv
