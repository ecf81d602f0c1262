"""Worker entry of `meshrun train`: every rank runs this under `meshrun launch`.

    meshrun launch --nproc-per-node 2 -m meshrun.train.worker --run-dir runs/NAME

The resolved config was validated and written to RUN_DIR/config.toml by `meshrun train`, so
every rank trains on exactly the same settings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from meshrun.config import load_config
from meshrun.errors import MeshrunError
from meshrun.train.profile import parse_steps

CONFIG_FILE = "config.toml"


def main(argv: list[str] | None = None, steps=None) -> int:
    """`steps`: the trainer's StepSource factory (train/trainer.py); meshrun.fault.worker passes
    torchft's, None trains in exact mode."""
    parser = argparse.ArgumentParser(prog="meshrun.train.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, help="run directory holding config.toml")
    parser.add_argument("--resume", help="this start's checkpoint.resume (meshrun train decides it); "
                                         "default: config.toml's")
    parser.add_argument("--profile", help="steps to profile, FIRST:LAST (meshrun train checked it)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    from meshrun.runtime import events  # timestamps that split a restart (benchmarks/goodput.py)

    started = round(time.time(), 4)  # recorded below: a finished run's directory is never written
    try:
        cfg = load_config(run_dir / CONFIG_FILE, [f"checkpoint.resume={args.resume}"] if args.resume else [])
        profile = parse_steps(args.profile, cfg.train.steps) if args.profile else None
    except MeshrunError as exc:
        print(f"meshrun train: error: {exc}", file=sys.stderr)
        return 2
    from meshrun.rundir.runs import finished_step

    done = finished_step(run_dir)
    if done is not None:  # e.g. the agent restarted the workers after the end: never train it again
        print(f"meshrun train: {run_dir} has finished (step {done}); not training it again", file=sys.stderr)
        return 0
    from meshrun.launch.preload import SERVER_VAR, stopped_by_agent

    forked = os.environ.get("MESHRUN_FORKSERVER_THREADS")  # set by a pre-imported worker (launch/preload.py)
    events.record(run_dir, "worker_start", time=started, proc_start=events.process_start_time(),
                  forkserver_threads=int(forked) if forked else None,
                  forkserver=(os.environ.get(SERVER_VAR) or "python") if forked else None)
    if cfg.parallel.strategy == "fsdp":
        from meshrun.runtime.alloc import configure_allocator

        # Freed all-gather buffers go back to the OS, so FSDP's savings show in RSS. Not for DDP:
        # mmap'ed buffers are zeroed on first touch, which slows CPU steps (docs/parallel.md).
        configure_allocator()
    if cfg.train.compile is not False:
        from meshrun.parallel.compile import use_run_cache

        use_run_cache(run_dir)  # before inductor reads it: a restarted run reuses the kernels
    from meshrun.runtime import session  # imports torch: timed apart from the rendezvous

    events.record(run_dir, "torch_imported")
    env = session.init()
    events.record(run_dir, "pg_ready")
    from meshrun.checkpoint import Preempted
    from meshrun.train.trainer import (  # after init: heavy imports off the error path
        EndedElsewhere,
        train,
    )

    try:
        result = train(cfg, env, run_dir, profile, steps=steps)
    except Preempted as exc:
        # SIGTERM/SIGINT (preemption): a checkpoint is committed; re-running the command continues.
        if env.is_main:
            print(f"meshrun train: {exc}; re-run the same command to continue", file=sys.stderr)
        session.shutdown()
        stopped_by_agent()  # a forked worker exits now, not after torch's 30 s (launch/preload.py)
        return 0
    except EndedElsewhere as exc:
        if env.is_main:
            print(f"meshrun train: {run_dir}: {exc}; their final weights are the run's", file=sys.stderr)
        session.shutdown()
        return 0
    except MeshrunError as exc:
        # Bad input found on the workers (data file, model factory): one line, exit 2.
        print(f"meshrun train: error: {exc}", file=sys.stderr)
        session.shutdown(failed=True)
        return exc.exit_code  # 2 for bad input; 1 for a failed job (e.g. DiskWriteError)
    if env.is_main:
        _finish_report(cfg, run_dir, result)
    session.shutdown()
    return 0


def _finish_report(cfg, run_dir: Path, result) -> None:
    """Render the curves into the run directory; a report problem never fails a finished run."""
    note = f"run directory: {run_dir} (weights {result.weights_path.name}"
    if cfg.metrics.jsonl:
        from meshrun.report import render_report

        try:
            note += f", report {render_report(run_dir, image_format=cfg.metrics.charts).name}"
        except MeshrunError as exc:
            note += f"; no report: {exc}"
    print(note + ")")


if __name__ == "__main__":
    sys.exit(main())
