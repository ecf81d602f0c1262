"""A `SubmitJob` on a Ray cluster: Ray Train's TorchTrainer runs meshrun's worker as its training function.

    meshrun submit examples/configs/tiny.toml --scheduler ray --nproc-per-node 2 --set train.name=tiny-ray
    meshrun submit my.toml --scheduler ray --address ray://head:10001 --nodes 2 --max-restarts 3

`meshrun submit` is the job's driver: it connects to the cluster (`--address`; none = RAY_ADDRESS,
else a new local Ray), claims the run directory as `meshrun train` does (its lock, history and
config.toml), then calls `TorchTrainer.fit()` and waits. Ray starts `nodes x nproc_per_node`
workers, sets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) and creates
the default process group itself (TorchConfig: gloo on CPU, nccl on GPUs); `train_function`
runs meshrun's worker entry (train/worker.py) on it, and `meshrun.init()` adopts that group
(runtime/session.py) rather than making a second one.

Failures: `--max-restarts R` is Ray's `FailureConfig(max_failures=R)`. When a worker dies, Ray
stops the whole worker group and starts a new one; its training function resumes from the run
directory's newest committed checkpoint, as a torchrun restart does: each worker group is one
attempt, counted by a small actor of this job and exported as TORCHELASTIC_RESTART_COUNT, which
is what checkpoint/selection.py reads to tell a restart (keep this job's progress) from the first
start (`checkpoint.resume` as given). The run directory must be on a filesystem every Ray node
and the driver share, at the same path. docs/cluster.md describes the flow and how to adapt it.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from meshrun.cluster.job import SubmitJob
from meshrun.errors import ConfigError, LaunchError, shown
from meshrun.extras import import_extra

PURPOSE = "meshrun submit --scheduler ray"
STORAGE_DIR = "ray"  # RUN/ray/: Ray Train's own run state (RunConfig.storage_path); meshrun keeps its checkpoints
PROBE_TIMEOUT_S = 5.0  # for something to accept a connection at --address
RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"  # the attempt, as torchrun names it (checkpoint/selection.py)


def require() -> None:
    """Ray Train is installed, or one line naming the extra."""
    import_extra("ray.train", PURPOSE, error=ConfigError)


def placement(job: SubmitJob) -> str:
    """Ray's placement strategy for `nodes x nproc_per_node` workers (one bundle each)."""
    if job.nodes == 1:
        return "STRICT_PACK"  # every worker on one node
    if job.nproc_per_node == 1:
        return "STRICT_SPREAD"  # one worker per node
    return "PACK"  # fewest nodes: nproc_per_node on each, on nodes of that size (docs/cluster.md)


def settings(job: SubmitJob, *, cwd: Path, resume: str = "auto") -> dict:
    """TorchTrainer's arguments as plain data (what --dry-run prints; `trainer` builds them)."""
    per_worker = {"CPU": 1, "GPU": 1} if job.gpus_per_node else {"CPU": 1}
    return {
        "train_loop_config": {"run_dir": str(job.run_dir), "resume": resume, "cwd": str(cwd)},
        "scaling_config": {"num_workers": job.world_size, "use_gpu": bool(job.gpus_per_node),
                           "resources_per_worker": per_worker, "placement_strategy": placement(job)},
        "torch_config": {"backend": "nccl" if job.gpus_per_node else "gloo"},
        "run_config": {"name": job.name, "storage_path": str(job.run_dir / STORAGE_DIR),
                       "failure_config": {"max_failures": job.max_restarts}},
    }


def render(job: SubmitJob, *, cwd: Path) -> str:
    """What `meshrun submit --scheduler ray` would run, as Python (`--dry-run`)."""
    s = settings(job, cwd=cwd)
    sc, rc = s["scaling_config"], s["run_config"]
    return "\n".join([
        f"# meshrun submit --scheduler ray: job {job.name} (docs/cluster.md); the driver runs this and waits",
        f"ray.init(address={job.address!r})",
        "TorchTrainer(",
        "    meshrun.cluster.ray.train_function,  # meshrun's worker entry on Ray's process group",
        f"    train_loop_config={s['train_loop_config']!r},",
        f"    scaling_config=ScalingConfig(num_workers={sc['num_workers']}, use_gpu={sc['use_gpu']}, "
        f"resources_per_worker={sc['resources_per_worker']!r}, placement_strategy={sc['placement_strategy']!r}),",
        f"    torch_config=TorchConfig(backend={s['torch_config']['backend']!r}),",
        f"    run_config=RunConfig(name={rc['name']!r}, storage_path={rc['storage_path']!r}, "
        f"failure_config=FailureConfig(max_failures={rc['failure_config']['max_failures']})),",
        ").fit()",
        "",
    ])


def probe(address: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Something answers at an --address HOST:PORT (Ray's GCS or its client server), or one line: ray.init
    would retry an address where nothing listens for minutes. None, auto and local are Ray's to resolve."""
    if address is None or address in ("auto", "local"):
        return
    client = address.startswith("ray://")
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep:
        host, port = address.removeprefix("ray://"), str(10001 if client else 6379)  # Ray's default ports
    if not host or not port.isdigit():
        raise ConfigError(f"--address {shown(address)}: give ray://HEAD:10001 (Ray Client), HEAD:6379, auto or local")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"--address {shown(address)}: nothing answers at {host}:{port} ({exc.strerror or exc}); "
                          "is the Ray head running there (`ray start --head`)?") from None


def connect(job: SubmitJob):
    """ray.init on the job's cluster, or one line naming --address."""
    probe(job.address)
    import ray

    kwargs = {"runtime_env": {"env_vars": dict(job.env)}} if job.env else {}
    try:
        ray.init(address=job.address, log_to_driver=True, **kwargs)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        where = f"--address {shown(job.address)}" if job.address else "RAY_ADDRESS" if os.environ.get(
            "RAY_ADDRESS") else "a local Ray"
        raise ConfigError(f"{where}: cannot connect to a Ray cluster ({first}); give the head's address, "
                          "e.g. --address ray://HEAD:10001 or --address HEAD:6379") from None
    return ray


def check_cluster(job: SubmitJob, nodes: list[dict]) -> None:
    """The cluster can place the job's workers at all (`ray.nodes()`), else one line: Ray would wait forever."""
    unit = "GPU" if job.gpus_per_node else "CPU"
    alive = [n.get("Resources", {}).get(unit, 0) for n in nodes if n.get("Alive")]  # each live node's CPUs/GPUs
    fit = [have for have in alive if have >= job.nproc_per_node]
    where = f"the Ray cluster ({len(alive)} node(s), {sum(alive):g} {unit})"
    if job.nodes > len(alive):
        raise ConfigError(f"--nodes {job.nodes}: {where} has {len(alive)}; give --nodes {len(alive)} or fewer, "
                          "or add nodes to the cluster")
    if job.nodes == 1 and not fit:
        raise ConfigError(f"--nproc-per-node {job.nproc_per_node}: no node of {where} has {job.nproc_per_node} "
                          f"{unit}s (the most is {max(alive, default=0):g}); give --nproc-per-node "
                          f"{int(max(alive, default=0))}, or --nodes 2 or more")
    if len(fit) < job.nodes:
        raise ConfigError(f"--nodes {job.nodes} --nproc-per-node {job.nproc_per_node}: {where} has {len(fit)} "
                          f"node(s) with {job.nproc_per_node} {unit}s; give --nodes {len(fit)} or a smaller "
                          "--nproc-per-node")


def trainer(job: SubmitJob, *, cwd: Path, resume: str):
    """The TorchTrainer of this job (Ray Train v2), with this fit's attempt counter."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    s = settings(job, cwd=cwd, resume=resume)
    rc = s["run_config"]
    config = {**s["train_loop_config"], "attempts": ray.remote(num_cpus=0)(Attempts).remote()}
    return TorchTrainer(train_function, train_loop_config=config, scaling_config=ScalingConfig(**s["scaling_config"]),
                        torch_config=TorchConfig(**s["torch_config"]),
                        run_config=RunConfig(name=rc["name"], storage_path=rc["storage_path"],
                                             failure_config=FailureConfig(**rc["failure_config"])))


def fit(job: SubmitJob, *, cwd: Path, resume: str) -> None:
    """Run the job to its end; a job Ray gave up on (restarts spent) is one LaunchError line, exit 1."""
    from ray.train import TrainingFailedError

    try:
        trainer(job, cwd=cwd, resume=resume).fit()
    except TrainingFailedError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise RayJobFailed(f"the Ray job {job.name} failed after --max-restarts {job.max_restarts} ({first}); "
                           f"the workers' output is above; re-running the same command resumes {job.run_dir}") from None


class RayJobFailed(LaunchError):
    """Ray gave up on the job (its restarts spent): a failed job, not bad input."""

    exit_code = 1


class Attempts:
    """This fit's worker groups, counted (a Ray actor): 0 for the first, 1 after Ray's first restart."""

    def __init__(self) -> None:
        self.started = 0

    def next(self) -> int:
        self.started += 1
        return self.started - 1


def train_function(config: dict) -> None:
    """Ray Train's training function on every worker: meshrun's worker entry, on the group Ray made."""
    import ray
    from ray.train import get_context
    from ray.train.collective import broadcast_from_rank_zero

    first = get_context().get_world_rank() == 0
    attempt = broadcast_from_rank_zero(ray.get(config["attempts"].next.remote()) if first else None)
    os.environ[RESTART_VAR] = str(attempt)  # a fresh Ray worker process per attempt: this one's alone
    os.chdir(config["cwd"])  # Ray moved it to its storage; the config's relative paths are the driver's
    from meshrun.train import worker

    code = worker.main(["--run-dir", config["run_dir"], "--resume", config["resume"]])
    if code:  # Ray restarts the group (FailureConfig) or ends the job; its message names this
        sys.stderr.flush()
        raise RuntimeError(f"meshrun's worker exited {code} (rank {get_context().get_world_rank()}, attempt {attempt})")


def submit(job: SubmitJob, cfg, *, cwd: Path) -> int:
    """Connect, check the cluster, claim the run directory as `meshrun train` does, fit; 0 when the run ended."""
    from meshrun.config import save_config
    from meshrun.rundir.history import plan_start, saved_form
    from meshrun.rundir.runs import claim_run_dir

    ray = connect(job)
    try:
        check_cluster(job, ray.nodes())  # before the run directory exists: a refusal leaves nothing behind
        run_dir, lock = claim_run_dir(cfg, None)  # held by this driver until the job ends; workers never lock
        with lock:
            start = plan_start(run_dir, cfg, force=False)  # refuses what would rewrite the run's history
            if start.finished:
                print(f"meshrun submit: {start.finished}", file=sys.stderr)
                return 0
            if start.write_config:
                save_config(saved_form(cfg), run_dir / "config.toml")
            print(f"meshrun submit: Ray job {job.name}: {job.world_size} worker(s), run directory {run_dir}",
                  file=sys.stderr)
            fit(job, cwd=cwd, resume=start.resume)
    finally:
        ray.shutdown()  # a local Ray this driver started goes with it
    print(f"meshrun submit: Ray job {job.name} finished; run directory {job.run_dir}", file=sys.stderr)
    return 0
