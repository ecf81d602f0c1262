"""`meshrun train [CONFIG.toml] [--set section.key=value ...] [launch options]`: the main job.

    meshrun train                                   # the embedded default: tiny Llama, built-in corpus, CPU
    meshrun train examples/configs/tiny.toml --set optim.lr=3e-4 --nproc-per-node 2

The config is resolved and checked here, once; runs/<name>/ is locked for the whole run
(rundir/: lock.py, runs.py), the start is checked against the run's history (rundir/history.py:
what would discard or rewrite it needs --force), and a new run's config is saved to
runs/<name>/config.toml; then the workers are started through `meshrun launch` (torchrun's agent),
so every launch option works.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from meshrun.argparser import OneLineParser, unknown_flag
from meshrun.config import JobConfig, load_config, save_config, set_hint
from meshrun.config.fault_section import is_torchft
from meshrun.errors import ConfigError, LaunchError, shown
from meshrun.launch.args import build_parser as build_launch_parser
from meshrun.launch.args import parse_nnodes
from meshrun.launch.preload import one_thread_torch
from meshrun.launch.spec import checked_options, launch_spec
from meshrun.rundir.runs import claim_run_dir
from meshrun.train.preflight import check_before_torch, check_with_torch
from meshrun.train.profile import parse_steps

# Launch options that make no sense here: the training target is meshrun's own worker.
_NOT_FOR_TRAIN = {"-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"}


def _launch_options() -> dict[str, bool]:
    """Every `meshrun launch` option string -> whether it takes a value."""
    options = {}
    for action in build_launch_parser()._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help") and flag not in _NOT_FOR_TRAIN:
                options[flag] = action.nargs != 0
    return options


def split_launch_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate launch options (torchrun's and meshrun's) from train's own arguments."""
    options = _launch_options()
    launch, rest, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        flag = token.split("=", 1)[0]
        if flag in options:
            launch.append(token)
            if options[flag] and "=" not in token and i + 1 < len(argv):
                launch.append(argv[i + 1])
                i += 1
        else:
            rest.append(token)
        i += 1
    return launch, rest


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="meshrun train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0],
        epilog=(
            "launch options: every `meshrun launch` option works here too (--nproc-per-node,\n"
            "--nnodes, --rdzv-endpoint, --max-restarts, --rank0-only, ...); see `meshrun launch --help`.\n"
            "They override the config's [launch] section.\n\n"
            "examples:\n"
            "  meshrun train                                     # default run, 2+ CPU processes\n"
            "  meshrun train examples/configs/tiny.toml --nproc-per-node 2\n"
            "  meshrun train --set train.steps=1000 --set train.dtype=bf16 --set data.path=data/tok\n"
            "  meshrun config show examples/configs/small.toml   # every key, its default and doc\n"
            "  meshrun train --set train.name=exp --set train.steps=2000 --force   # train a finished run further\n"
            "\nA run writes runs/<name>/: config.toml, metrics.jsonl, model.pt, report.html, logs/."
        ),
    )
    parser.add_argument("config", nargs="?", help="TOML config file; omitted = the embedded default")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key (repeatable), e.g. --set optim.lr=3e-4")
    parser.add_argument("--resume", metavar="auto|never|PATH|STEP",
                        help="checkpoint.resume: 'auto' (default) = the run directory's latest valid checkpoint, "
                             "'never' = start fresh, a checkpoint directory, or a step of this run "
                             "(step-00000010 or 10, with train.name; docs/checkpoint.md); "
                             "discarding a run's later checkpoints needs --force")
    parser.add_argument("--force", action="store_true",
                        help="let this start discard or replace part of an existing run's history: train a "
                             "finished run further (its model.pt is kept as model.step-N.pt), roll back "
                             "(--resume PATH/never: later checkpoints are renamed *.abandoned-<session>), "
                             "resume a run beyond a lower train.steps, or continue it with other settings "
                             "(the old config.toml is kept). Without it such a start is refused (exit 2)")
    parser.add_argument("--dry-run", action="store_true",
                        help="launch nothing: build the config's real layout at the launch's world size (--nnodes x "
                             "--nproc-per-node, or [launch]) and run one training step per representative rank "
                             "under torch's fake process group and fake tensors, then print what each rank holds "
                             "and sends, as `meshrun plan CONFIG --simulate` does (docs/plan.md)")
    parser.add_argument("--device", metavar="NAME",
                        help="--dry-run: project step time, tokens/s and MFU on this GPU (a100, h100, h200, b200)")
    parser.add_argument("--inter-node-gbps", type=float, metavar="GBITS",
                        help="--dry-run --device: network bandwidth per GPU between nodes, Gb/s (default 400)")
    parser.add_argument("--compute-efficiency", type=float, metavar="FRACTION",
                        help="--dry-run --device: share of the dense peak the model's FLOPs run at")
    parser.add_argument("--profile", metavar="STEPS",
                        help="record torch.profiler traces of these training steps on every rank: FIRST:LAST "
                             "(both included, e.g. 10:12) or one step (5); Chrome traces go to "
                             "runs/<name>/profile/rank<N>.json and `meshrun report` summarises them")
    return parser


def _launch_argv_from_config(cfg: JobConfig, cli_launch: list[str]) -> list[str]:
    """The [launch] section as torchrun flags, each only when the command line did not set it."""
    given = {token.split("=", 1)[0].replace("_", "-") for token in cli_launch if token.startswith("-")}
    section = cfg.launch
    pairs = [
        ("--nproc-per-node", str(section.nproc_per_node)),
        ("--max-restarts", str(section.max_restarts)),
        ("--nnodes", str(section.nnodes)),
        ("--rdzv-backend", section.rdzv_backend),
        ("--rdzv-id", str(section.rdzv_id)),
    ]
    if section.rdzv_endpoint:
        pairs.append(("--rdzv-endpoint", section.rdzv_endpoint))
    # Defaults stay unset, so that SLURM (launch/slurm.py) can fill in the nodes and rendezvous.
    defaults = {"--nnodes": "1", "--rdzv-backend": "static", "--rdzv-id": "none"}
    argv = []
    for flag, value in pairs:
        if flag not in given and defaults.get(flag) != value:
            argv += [flag, value]
    return argv


def _name_config_key(exc: LaunchError, launch_argv: list[str]) -> LaunchError:
    """A launch option's error, naming the [launch] key it came from when the config set it."""
    message = str(exc)
    for token in launch_argv:
        flag = token.partition("=")[0]
        if not flag.startswith("--"):
            continue
        if f"{flag}=" in message or f"{flag} " in message or f"{flag}:" in message:
            key = "launch." + flag.lstrip("-").replace("-", "_")
            return LaunchError(f"{key} in the config: {message}")
    return exc


def check_unknown_flags(parser: argparse.ArgumentParser, rest: list[str]) -> None:
    """A flag that is neither train's nor a launch option: one line, with `--set` when it names a
    config key (`--steps 20` -> did you mean `--set train.steps=20`?)."""
    own = {flag for action in parser._actions for flag in action.option_strings}
    for i, token in enumerate(rest):
        if token == "--":
            return
        flag, eq, value = token.partition("=")
        if not token.startswith("-") or flag in own or token.lstrip("-").replace(".", "").isdigit():
            continue
        if not eq:
            following = rest[i + 1] if i + 1 < len(rest) else None
            value = following if following is not None and not following.startswith("--") else None
        raise ConfigError(unknown_flag(flag, [*own, *_launch_options()], hint=set_hint(flag, value),
                                       fallback="see `meshrun train --help` (config keys go in --set section.key=value)"))


def check_train_args(argv: list[str]) -> tuple[argparse.Namespace, JobConfig, argparse.Namespace, argparse.Namespace]:
    """(train's args, config, launch args, checked launch options) of a `meshrun train` command line, every key
    and flag checked; torch-free and creates nothing, so a mistake is one line in a fraction of a
    second (benchmarks/reject_time.py). Raises a MeshrunError naming the key or flag."""
    cli_launch, rest = split_launch_args(argv)
    parser = build_parser()
    check_unknown_flags(parser, rest)
    args = parser.parse_args(rest)
    if args.config and not os.path.isfile(args.config):
        what = "is a directory, not a .toml file" if os.path.isdir(args.config) else "not found"
        raise ConfigError(f"config file {shown(args.config)} {what}; see examples/configs/ for examples")
    overrides = args.overrides + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    cfg = load_config(args.config, overrides)
    if cfg.checkpoint.resume not in ("auto", "never"):
        from meshrun.checkpoint.selection import resume_by_step

        resume = resume_by_step(cfg.checkpoint.resume, Path(cfg.train.run_dir) / cfg.train.name
                                if cfg.train.name else None)
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=resume))
    if args.profile is not None:
        parse_steps(args.profile, cfg.train.steps)  # one line and exit 2 before anything starts
    for key in _DRY_RUN_ONLY:
        if getattr(args, key) is not None:
            raise ConfigError(f"--{key.replace('_', '-')} needs --dry-run: it sizes a projection, not a run")
    from_config = _launch_argv_from_config(cfg, cli_launch)
    try:
        launch_args = build_launch_parser().parse_args(from_config + cli_launch + ["-m", "meshrun.train.worker"])
        options = checked_options(launch_args)  # every flag, SLURM's filled in: may say there are several nodes
    except LaunchError as exc:
        raise _name_config_key(exc, from_config) from None
    check_before_torch(cfg, nproc_per_node=options.nproc_per_node, nnodes=options.nnodes)  # train/preflight.py
    return args, cfg, launch_args, options


_DRY_RUN_ONLY = ("device", "inter_node_gbps", "compute_efficiency")


def dry_run(argv: list[str]) -> int:
    """`meshrun train ... --dry-run`: the same command line checked as a launch would check it, then
    `meshrun plan CONFIG --simulate` at the launch's world (meshrun.cli.plan; nothing is launched,
    no run directory is made). Launch options other than the world's are accepted and unused."""
    from meshrun.cli import plan as plan_cli
    from meshrun.train.preflight import launch_ranks

    cli_launch, rest = split_launch_args(argv)
    parser = build_parser()
    check_unknown_flags(parser, rest)
    args = parser.parse_args(rest)
    launch = build_launch_parser().parse_args(cli_launch + ["-m", "meshrun.train.worker"])
    cfg = load_config(args.config, args.overrides) if args.config is None or os.path.isfile(args.config) else None
    if cfg is None:
        raise ConfigError(f"config file {shown(args.config)} not found; see examples/configs/ for examples")
    given = {token.split("=", 1)[0] for token in cli_launch}
    nproc = launch.nproc_per_node if "--nproc-per-node" in given or "--nproc_per_node" in given \
        else str(cfg.launch.nproc_per_node)
    nnodes = launch.nnodes if "--nnodes" in given else str(cfg.launch.nnodes)
    per_node, world = launch_ranks(nproc, nnodes)
    plan_argv = [*([args.config] if args.config else []), *(f"--set={o}" for o in args.overrides), "--simulate",
                 "--nnodes", str(world // per_node), "--nproc-per-node", str(per_node)]
    for key in _DRY_RUN_ONLY:
        if getattr(args, key) is not None:
            plan_argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return plan_cli.main(plan_argv)


def main(argv: list[str]) -> int:
    if "--dry-run" in argv[: argv.index("--") if "--" in argv else len(argv)]:
        return dry_run(argv)
    with one_thread_torch():  # so that the workers' server can be forked from here (launch/preload.py)
        args, cfg, launch_args, options = check_train_args(argv)
        from meshrun.launch.launcher import check_log_dir, run_spec  # torch from here on

    plan = launch_spec(launch_args, checked=options)
    check_with_torch(cfg, nproc_per_node=plan.nproc_per_node, nnodes=plan.nnodes)  # train/preflight.py
    from meshrun.rundir.history import plan_start, saved_form

    multi_node = parse_nnodes(plan.nnodes)[1] > 1
    job = f"{plan.options.rdzv_endpoint}|{plan.options.rdzv_id}" if multi_node else None
    check_log_dir(plan.log_dir)  # before the run directory exists: a failure here leaves none behind
    run_dir, lock = claim_run_dir(cfg, job)  # held until the run ends: one owner per run directory
    with lock:
        start = plan_start(run_dir, cfg, force=args.force)  # refuses what would rewrite the run's history
        if start.finished:
            print(f"meshrun train: {start.finished}", file=sys.stderr)
            return 0
        if start.write_config:  # a new run, or new settings with --force; a refused start never gets here
            save_config(saved_form(cfg), run_dir / "config.toml")
        plan = plan.with_run(log_dir=plan.log_dir or str(run_dir / "logs"),
                             script_args=["--run-dir", str(run_dir), "--resume", start.resume]
                             + (["--profile", args.profile] if args.profile else []))
        print(f"meshrun train: run directory {run_dir}", file=sys.stderr)
        if is_torchft(cfg):  # replica groups under torchft's lighthouse (meshrun.fault.launch)
            from meshrun.fault.launch import run_replica_groups

            return run_replica_groups(cfg, plan, run_dir)
        from meshrun.checkpoint.preemption import preempted_exit_code
        from meshrun.checkpoint.snapshot_area import fixed_interval, snapshot_area
        from meshrun.launch.torch_elastic import SignalException

        started = time.time()
        try:
            with snapshot_area(enabled=fixed_interval(cfg.checkpoint.snapshot_interval) != 0):  # /dev/shm
                return run_spec(plan)
        except SignalException as exc:  # SIGTERM/SIGINT to the agent; it has stopped the workers
            return preempted_exit_code(run_dir, exc.sigval, since=started)
