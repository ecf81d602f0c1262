"""`meshrun submit --scheduler ray` without a cluster: the --dry-run call, the cluster-size check on
`ray.nodes()`-shaped rows, flags of other schedulers refused, and meshrun's SIGTERM handlers on a
thread other than the main one (Ray Train's). tests/e2e/test_submit_ray_jobs.py runs real jobs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from conftest import TINY

from meshrun.cli import main
from meshrun.cluster import ray
from meshrun.cluster.job import SubmitJob
from meshrun.errors import ConfigError


def _args(tmp_path, *extra: str) -> list[str]:
    return ["submit", TINY, "--scheduler", "ray", "--set", "train.name=r1", "--set", f"train.run_dir={tmp_path}", *extra]


@pytest.mark.timeout(60)
def test_dry_run_prints_the_trainer_and_writes_nothing(tmp_path, capsys):
    assert main(_args(tmp_path, "--nodes", "2", "--nproc-per-node", "1", "--max-restarts", "3",
                      "--address", "ray://head:10001", "--dry-run")) == 0
    out = capsys.readouterr().out
    assert "ray.init(address='ray://head:10001')" in out
    assert ("ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={'CPU': 1}, "
            "placement_strategy='STRICT_SPREAD')") in out
    assert "FailureConfig(max_failures=3)" in out and "TorchConfig(backend='gloo')" in out
    assert f"'run_dir': '{tmp_path.resolve()}/r1'" in out and f"storage_path='{tmp_path.resolve()}/r1/ray'" in out
    assert not (tmp_path / "r1").exists()


@pytest.mark.parametrize("nodes, nproc, strategy", [(1, 2, "STRICT_PACK"), (3, 1, "STRICT_SPREAD"), (2, 4, "PACK")])
def test_placement(nodes, nproc, strategy):
    job = SubmitJob(config=Path("c.toml"), name="r", run_root=Path("/runs"), nodes=nodes, nproc_per_node=nproc)
    assert ray.placement(job) == strategy


def _node(cpus: float, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {"CPU": cpus}}


@pytest.mark.parametrize("nodes, nproc, cluster, says", [
    (3, 1, [_node(1), _node(1), _node(1, alive=False)], "--nodes 3: the Ray cluster (2 node(s), 2 CPU) has 2; give --nodes 2"),
    (1, 4, [_node(2), _node(2)], "--nproc-per-node 4: no node of the Ray cluster (2 node(s), 4 CPU) has 4 CPUs"),
    (2, 2, [_node(2), _node(1)], "--nodes 2 --nproc-per-node 2: the Ray cluster (2 node(s), 3 CPU) has 1 node(s) with 2 CPUs"),
])
def test_a_cluster_too_small_is_one_line(nodes, nproc, cluster, says):
    job = SubmitJob(config=Path("c.toml"), name="r", run_root=Path("/runs"), nodes=nodes, nproc_per_node=nproc)
    with pytest.raises(ConfigError) as info:
        ray.check_cluster(job, cluster)
    assert str(info.value).startswith(says), str(info.value)
    ray.check_cluster(SubmitJob(config=Path("c.toml"), name="r", run_root=Path("/runs")), cluster)  # 1 x 1 fits


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheduler, extra, says", [
    ("ray", ["--time", "01:00:00"], "--time is for --scheduler slurm"),
    ("ray", ["--sbatch=--mem=8G"], "--sbatch is for --scheduler slurm"),
    ("ray", ["--image", "img:1"], "--image is for --scheduler kubernetes; leave it out with --scheduler ray"),
    ("slurm", ["--address", "auto"], "--address is for --scheduler ray; leave it out with --scheduler slurm"),
    ("kubernetes", ["--address", "auto"], "--address is for --scheduler ray; leave it out with --scheduler kubernetes"),
])
def test_other_schedulers_flags_are_refused(tmp_path, capsys, scheduler, extra, says):
    argv = ["submit", TINY, "--scheduler", scheduler, "--set", "train.name=r1", "--set", f"train.run_dir={tmp_path}",
            *extra, "--dry-run"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "r1").exists()


@pytest.mark.parametrize("address, says", [
    ("127.0.0.1:1", "--address '127.0.0.1:1': nothing answers at 127.0.0.1:1"),
    ("ray://127.0.0.1:1", "--address 'ray://127.0.0.1:1': nothing answers at 127.0.0.1:1"),
    ("ray://:x", "--address 'ray://:x': give ray://HEAD:10001"),
])
def test_an_address_where_nothing_answers_is_one_line(address, says):
    with pytest.raises(ConfigError) as info:
        ray.probe(address, timeout_s=2)
    assert str(info.value).startswith(says), str(info.value)
    ray.probe(None)
    ray.probe("auto")


def test_preemption_handlers_only_on_the_main_thread():
    """Ray Train runs the training function on a thread: meshrun's SIGTERM handlers are then not installed
    (Python refuses them there), and the process's own stay."""
    import signal

    from meshrun.checkpoint.preemption import PreemptionSignals

    before = signal.getsignal(signal.SIGTERM)
    made: list = []
    thread = threading.Thread(target=lambda: made.append(PreemptionSignals()))
    thread.start()
    thread.join(10)
    assert made and signal.getsignal(signal.SIGTERM) == before
    made[0].restore()
    assert signal.getsignal(signal.SIGTERM) == before
