"""`meshrun submit CONFIG --scheduler slurm|kubernetes|ray ...`: one `meshrun train` job onto a cluster.

    meshrun submit examples/configs/tiny.toml --nodes 2 --nproc-per-node 4 --time 01:00:00 --dry-run
    meshrun submit examples/configs/tiny.toml --nodes 2 --nproc-per-node 4 --time 01:00:00
    meshrun submit --status runs/tiny          # squeue for the job submitted for that run (or a job id)
    meshrun submit --cancel runs/tiny          # scancel it
    meshrun submit examples/configs/tiny.toml --scheduler ray --nproc-per-node 2 --set train.name=tiny-ray

The job (cluster/job.py) and the config are checked as `meshrun train` checks them, for the
whole world (nodes x processes), before anything is written or submitted: a mistake is one line
and exit 2. SLURM: the sbatch script goes to RUN/slurm/job.sbatch (cluster/slurm.py), SLURM
checks it (`sbatch --test-only`), then `sbatch --parsable` submits it and the job id is printed
and recorded in RUN/slurm/job_id. Ray: this process is the job's driver and waits for it
(cluster/ray.py: Ray Train's TorchTrainer). docs/cluster.md describes what each writes and runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from meshrun.argparser import OneLineParser
from meshrun.errors import ConfigError, shown

SCHEDULERS = ("slurm", "kubernetes", "ray")
K8S_KINDS = ("trainjob", "jobset")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="meshrun submit", formatter_class=argparse.RawDescriptionHelpFormatter,
                           description=__doc__.split("\n\n")[0], epilog="docs/cluster.md: what is written, and how to adapt it")
    parser.add_argument("config", nargs="?", help="the job's TOML config (with --status/--cancel: a job id, "
                                                  "a run directory, or the config of a submitted run)")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="slurm", help="where the job goes (default slurm)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (one `meshrun train` agent each)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="worker processes per node")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node; 0 = CPU workers (gloo)")
    parser.add_argument("--time", help="the job's time limit (SLURM's format: HH:MM:SS, MM, D-HH:MM:SS)")
    parser.add_argument("--partition", help="SLURM partition")
    parser.add_argument("--account", help="SLURM account")
    parser.add_argument("--sbatch", dest="extra", action="append", default=[], metavar="LINE",
                        help="one more #SBATCH line, passed through (repeatable), e.g. --sbatch=--mem=32G")
    parser.add_argument("--signal-lead", type=int, default=None, metavar="SECONDS",
                        help="SLURM: seconds before the time limit that SIGUSR1 asks for a checkpoint and a "
                             "requeue (default 90)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key (repeatable), passed on to `meshrun train`")
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun's --max-restarts on every node; "
                        "Ray: FailureConfig(max_failures), worker-group restarts")
    parser.add_argument("--address", help="Ray: the cluster, ray://HEAD:10001 (Ray Client), HEAD:6379 or auto; "
                                           "default RAY_ADDRESS, else a new local Ray on this machine")
    parser.add_argument("--image", help="Kubernetes: container image with meshrun and the config")
    parser.add_argument("--volume", help="Kubernetes: PersistentVolumeClaim mounted at train.run_dir")
    parser.add_argument("--namespace", help="Kubernetes namespace")
    parser.add_argument("--k8s-kind", choices=K8S_KINDS, default="trainjob", help="Kubernetes: TrainJob or JobSet")
    parser.add_argument("--script", help="SLURM: where to write the sbatch script (default RUN/slurm/job.sbatch)")
    parser.add_argument("--force", action="store_true", help="replace a --script file meshrun did not write")
    parser.add_argument("--dry-run", action="store_true", help="print the script (manifest); write and submit nothing")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--status", action="store_true", help="squeue for a submitted job")
    what.add_argument("--cancel", action="store_true", help="scancel a submitted job")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.status or args.cancel:
        return _status_or_cancel(args)
    if not args.config:
        raise ConfigError("meshrun submit needs a CONFIG (a TOML file), e.g. meshrun submit "
                          "examples/configs/tiny.toml --nodes 2 --nproc-per-node 4 --dry-run")
    _refuse_other_schedulers_flags(args)
    if args.scheduler == "slurm":
        return _slurm(args)
    if args.scheduler == "ray":
        return _ray(args)
    return _kubernetes(args)


def _job(args: argparse.Namespace, cfg):
    """The SubmitJob of these arguments (its own checks: one line each)."""
    from meshrun.cluster.job import SubmitJob

    if not cfg.train.name:
        raise ConfigError("train.name is not set: a cluster job needs a named run (the requeued job must find "
                          "its run directory); add --set train.name=NAME")
    # SLURM's nodes share this machine's filesystem: absolute paths. A Kubernetes pod reads the config
    # inside its image and the run directory on its volume: the paths as given (kubernetes.py checks them).
    shared = args.scheduler in ("slurm", "ray")
    config, run_root = Path(args.config), Path(cfg.train.run_dir)
    return SubmitJob(config=config.resolve() if shared else config, name=cfg.train.name,
                     run_root=run_root.resolve() if shared else run_root, nodes=args.nodes,
                     nproc_per_node=args.nproc_per_node, gpus_per_node=args.gpus_per_node,
                     overrides=tuple(o for o in args.overrides if not o.startswith(("train.name=", "train.run_dir="))),
                     max_restarts=args.max_restarts, time_limit=args.time, partition=args.partition,
                     account=args.account, extra=tuple(args.extra), image=args.image, volume=args.volume,
                     namespace=args.namespace, address=args.address)


def _checked(args: argparse.Namespace):
    """(config, SubmitJob): every key and flag as `meshrun train` checks them, for the whole world."""
    from meshrun.cli.train import check_train_args
    from meshrun.train.preflight import check_with_torch

    if args.nodes < 1 or args.nproc_per_node < 1:
        flag, value = ("--nodes", args.nodes) if args.nodes < 1 else ("--nproc-per-node", args.nproc_per_node)
        raise ConfigError(f"{flag} {value}: must be at least 1")
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "submit-check"]
    sets = [token for o in args.overrides for token in ("--set", o)]
    world = ["--nnodes", str(args.nodes), "--nproc-per-node", str(args.nproc_per_node),
             "--max-restarts", str(max(args.max_restarts, 0))]
    _, cfg, _, _ = check_train_args([args.config, *sets, *world, *rendezvous])
    job = _job(args, cfg)
    check_with_torch(cfg, nproc_per_node=str(args.nproc_per_node), nnodes=str(args.nodes))  # the layout, the data
    return cfg, job


# Flags only one scheduler reads, refused with the others (--scheduler kubernetes leaves SLURM's unread).
_ONLY_FOR = {"image": "kubernetes", "volume": "kubernetes", "namespace": "kubernetes", "address": "ray"}
_NOT_FOR_RAY = {"time": "--time", "partition": "--partition", "account": "--account", "extra": "--sbatch",
                "signal_lead": "--signal-lead", "script": "--script", "force": "--force"}


def _refuse_other_schedulers_flags(args: argparse.Namespace) -> None:
    for dest, scheduler in _ONLY_FOR.items():
        if getattr(args, dest) and args.scheduler != scheduler:
            raise ConfigError(f"--{dest} is for --scheduler {scheduler}; leave it out with --scheduler {args.scheduler}")
    if args.scheduler == "ray":
        for dest, flag in _NOT_FOR_RAY.items():
            if getattr(args, dest) not in (None, False, []):
                raise ConfigError(f"{flag} is for --scheduler slurm; Ray has no such setting (docs/cluster.md: "
                                  "how to adapt the Ray job)")


def _slurm(args: argparse.Namespace) -> int:
    from meshrun.checkpoint.outputs import check_output
    from meshrun.cluster import slurm

    if not args.dry_run:
        slurm.require("sbatch", "squeue", "scontrol")
    _, job = _checked(args)
    kwargs = {} if args.signal_lead is None else {"signal_lead_s": args.signal_lead}
    text = slurm.render(job, python=sys.executable, **kwargs)
    if args.dry_run:
        print(text, end="")
        return 0
    path = Path(args.script).resolve() if args.script else slurm.script_path(job)
    check_output("--script", path, inputs=[job.config], force=args.force, ours=slurm.is_ours)
    path.parent.mkdir(parents=True, exist_ok=True)
    (job.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    slurm.check_with_sbatch(path)
    job_id = slurm.submit(path)
    print(job_id)
    print(f"meshrun submit: job {job_id} submitted ({job.nodes} node(s) x {job.nproc_per_node}); script {path}, "
          f"output {job.run_dir / 'logs'}/slurm-{job_id}.out; `meshrun submit --status {job.run_dir}`",
          file=sys.stderr)
    return 0


def _kubernetes(args: argparse.Namespace) -> int:
    try:
        from meshrun.cluster.kubernetes import render, submit  # cluster/kubernetes.py
    except ModuleNotFoundError as exc:
        if exc.name != "meshrun.cluster.kubernetes":
            raise
        raise ConfigError("--scheduler kubernetes is not in this meshrun yet; use --scheduler slurm") from None
    _, job = _checked(args)
    text = render(job, args.k8s_kind)
    if args.dry_run:
        print(text, end="")
        return 0
    print(submit(job, args.k8s_kind, text))
    return 0


def _ray(args: argparse.Namespace) -> int:
    from meshrun.cluster import ray

    if not args.dry_run:
        ray.require()  # one line naming meshrun[ray], before the config's checks import torch
    cfg, job = _checked(args)
    if args.dry_run:
        print(ray.render(job, cwd=Path.cwd()), end="")
        return 0
    return ray.submit(job, cfg, cwd=Path.cwd())


def _status_or_cancel(args: argparse.Namespace) -> int:
    from meshrun.cluster import slurm

    if args.scheduler != "slurm":
        raise ConfigError("--status/--cancel: only --scheduler slurm; for Kubernetes use kubectl; a Ray job's "
                          "driver (meshrun submit) waits for it: Ctrl-C stops it")
    flag = "--status" if args.status else "--cancel"
    slurm.require("squeue" if args.status else "scancel")
    job_id = _job_id(args.config, args.overrides, flag)
    print(slurm.status(job_id) if args.status else slurm.cancel(job_id))
    return 0


def _job_id(target: str | None, overrides: list[str], flag: str) -> str:
    """A job id as given, or the one recorded for a run directory or a submitted config's run."""
    from meshrun.cluster import slurm

    if target is None:
        raise ConfigError(f"{flag} needs a job id, a run directory or the config of a submitted run, e.g. "
                          f"meshrun submit {flag} runs/NAME")
    if target.replace("_", "").isdigit():
        return target
    if os.path.isfile(target):
        from meshrun.config import load_config

        cfg = load_config(target, overrides)
        if not cfg.train.name:
            raise ConfigError(f"{flag} {shown(target)}: the config sets no train.name; give the run directory or job id")
        return slurm.recorded_job_id(Path(cfg.train.run_dir) / cfg.train.name)
    if os.path.isdir(target):
        return slurm.recorded_job_id(Path(target))
    raise ConfigError(f"{flag} {shown(target)}: not a job id, a run directory or a config file")
