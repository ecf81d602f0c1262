"""Checkpoint figures: DCP save throughput vs torch.save, async save's blocking time, SIGKILL recovery.

    python benchmarks/checkpoint.py                  # 2 CPU processes, ~12M-parameter model (157 MB state); ~30 s
    python benchmarks/checkpoint.py --model base     # the `base` size (126M parameters, 1.5 GB state); a few minutes
    python benchmarks/checkpoint.py --dim 256 --timeout 300

1. Save throughput (MB/s): the full training state (model + AdamW moments) written with
   `dcp.save` from 2 ranks, vs rank 0's `torch.save` of the same state, in the same processes,
   like with like: both fsync'd (what meshrun's checkpoints are: on disk when committed) and
   both to the page cache only (no fsync). The kinds of save take turns within each repeat, and
   each measurement starts after `os.sync()`: no dirty pages of the one before.
2. Async save: what it costs the training loop, as a fraction of a synchronous `dcp.save`'s time,
   three ways: the call with meshrun's OwnedStager, which copies only the tensors this rank
   writes (what the Checkpointer does); the call with DCP's DefaultStager, which copies the whole
   state; and DCP's background staging beside the next step's forward and backward, the
   optimizer step waiting for it (cost: how much longer that step takes than one without a save).
   Target <= 0.05. Measured here (2 ranks on 2 cores): 0.07, 0.13 and 0.4. What blocks is a
   memcpy, at about 4.5 GB/s on each rank when both copy at once: this rank's half of the state
   alone is 0.05 of an fsync'd save on this disk. Beside the step, the copy competes with the step
   for the same cores, so the Checkpointer stages in the call; beside the step is for
   accelerators, where the copy is a device-to-host transfer.
3. Recovery: `meshrun train` on 2 processes with --max-restarts 1, one worker SIGKILLed; seconds
   from the kill to the first step the restarted workers complete (from the per-sample log).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _model_args(model: str | None, dim: int, n_layers: int):
    from meshrun.models.llama import ModelArgs
    from meshrun.models.sizes import get_size

    if model:
        return get_size(model, key="--model")
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=8, n_kv_heads=8, vocab_size=259, max_seq_len=64)


def _torch_save(state: dict, path: str, fsync: bool) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _save_figures(model_name: str | None, dim: int, n_layers: int, repeats: int, workdir: str) -> dict:
    """On each rank: build the same model + optimizer state, time sync/async DCP and torch.save."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from meshrun.models.llama import Transformer

    rank = dist.get_rank()
    model = Transformer(_model_args(model_name, dim, n_layers), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 259, (2, 16))).float().sum().backward()
    opt.step()  # AdamW moments exist: the state a checkpoint really holds
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    nbytes = sum(t.numel() * t.element_size() for part in state.values() for t in _tensors(part))
    async_group = dist.new_group(backend="gloo")
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from meshrun.checkpoint.staging import OwnedStager

    # reused across saves, as meshrun's Checkpointer keeps its own: meshrun's staging in the call of
    # this rank's share (what the Checkpointer does), DCP's of the whole state in the call, and DCP's
    # in the background beside the next step (compared, not used)
    stager = OwnedStager(async_group)
    whole = DefaultStager(StagingOptions(False, False, False, False))
    overlapped = DefaultStager(StagingOptions(False, False, True, False))
    tokens = torch.randint(0, 259, (2, 16))

    def compute() -> None:  # the next step's forward and backward, which the background copy overlaps
        model(tokens).float().sum().backward()

    def settled() -> float:  # each measurement starts from a quiet disk: no dirty pages of the one before
        os.sync()
        dist.barrier()
        return time.perf_counter()

    def async_call(name: str, stager_, **kwargs) -> float:  # seconds in the call: what the loop waits for
        t0 = settled()
        future = dcp.async_save(state, checkpoint_id=os.path.join(workdir, name), process_group=async_group,
                                async_stager=stager_, **kwargs)
        seconds = time.perf_counter() - t0  # the loop would continue from here
        getattr(future, "upload_completion", future).result()
        return seconds

    sync_s, nosync_s, torch_s, torch_sync_s, block_s, whole_s, step_s, overlap_s = [], [], [], [], [], [], [], []
    for i in range(repeats):
        path = os.path.join(workdir, f"dcp-{i}")
        t0 = settled()
        dcp.save(state, checkpoint_id=path)
        dist.barrier()
        sync_s.append(time.perf_counter() - t0)
        t0 = settled()  # the same without fsync, as torch.save writes
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path + "-nosync", sync_files=False))
        dist.barrier()
        nosync_s.append(time.perf_counter() - t0)
        for fsync, times in ((True, torch_sync_s), (False, torch_s)):
            t0 = settled()
            if rank == 0:
                _torch_save(state, os.path.join(workdir, f"full-{i}-{fsync}.pt"), fsync)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        block_s.append(async_call(f"async-{i}", stager, planner=stager.planner()))
        whole_s.append(async_call(f"whole-{i}", whole))
        t0 = settled()
        compute()
        step_s.append(time.perf_counter() - t0)  # the step without a save
        t0 = settled()
        future = dcp.async_save(state, checkpoint_id=os.path.join(workdir, f"overlap-{i}"),
                                process_group=async_group, async_stager=overlapped)
        compute()
        future.staging_completion.result()  # what meshrun's optimizer-step hook waits for
        overlap_s.append(time.perf_counter() - t0)  # minus the step itself: what the save cost the loop
        future.upload_completion.result()
        dist.barrier()
        if rank == 0:  # this repeat's files: the disk holds one repeat's at a time
            for entry in Path(workdir).iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        dist.barrier()
    overlapped.close()
    whole.close()
    stager.close()
    return {"bytes": nbytes, "sync_s": statistics.median(sync_s), "nosync_s": statistics.median(nosync_s),
            "torch_s": statistics.median(torch_s), "torch_sync_s": statistics.median(torch_sync_s),
            "async_block_s": statistics.median(block_s), "whole_block_s": statistics.median(whole_s), "step_s": statistics.median(step_s),
            "overlap_block_s": max(statistics.median(overlap_s) - statistics.median(step_s), 0.0)}


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _recovery(workdir: Path, timeout: float) -> dict:
    """Seconds from SIGKILL of one worker to the first step completed by the restarted group."""
    from meshrun.testing.processes import (  # by pid, never by name
        kill_tree,
        worker_pids,
    )

    meshrun = Path(sys.executable).parent / "meshrun"
    cmd = [str(meshrun), "train", str(REPO / "examples/configs/tiny.toml"), "--nproc-per-node", "2",
           "--max-restarts", "1", "--set", "train.name=recovery", "--set", f"train.run_dir={workdir}",
           "--set", "train.steps=400", "--set", "train.eval_interval=0", "--set", "checkpoint.interval=5",
           "--set", "checkpoint.sample_log=true", "--set", "metrics.jsonl=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = open(workdir / "recovery.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log = workdir / "recovery" / "samples" / "rank-00000.jsonl"
    deadline = time.monotonic() + timeout
    try:
        while not (log.is_file() and sum(1 for _ in log.open()) >= 12):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the training run never reached step 12")
            time.sleep(0.01)
        first_session = json.loads(log.read_text().splitlines()[0])["session"]
        workers = worker_pids(proc.pid)
        victim = random.choice(workers)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while True:
            rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            resumed = [r for r in rows if r["session"] != first_session]
            if resumed:
                return {"recovery_s": time.monotonic() - killed_at, "resumed_step": resumed[0]["step"],
                        "killed_after_step": max(r["step"] for r in rows if r["session"] == first_session)}
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the restarted workers never completed a step: "
                                   + (workdir / "recovery.log").read_text()[-3000:])
            time.sleep(0.01)
    finally:
        kill_tree(proc.pid)
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a named size (e.g. base: 126M parameters) instead of --dim/--n-layers")
    parser.add_argument("--dim", type=int, default=512, help="model width (default 512: ~12M parameters)")
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="saves of each kind; the median is reported")
    parser.add_argument("--timeout", type=float, default=240, help="seconds for each part, processes included")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from meshrun.testing import run_distributed

    workdir = Path(tempfile.mkdtemp(prefix="meshrun-ckpt-bench-"))
    try:
        figures = run_distributed(_save_figures, world_size=2, timeout=args.timeout,
                                  args=(args.model, args.dim, args.n_layers, args.repeats, str(workdir)))[0]
        mb = figures["bytes"] / 1e6
        print(f"state: {mb:.1f} MB (model + AdamW, {args.model or f'dim {args.dim}'}), 2 ranks on CPU, "
              f"median of {args.repeats}")
        for label, dcp_key, torch_key in (("fsync'd", "sync_s", "torch_sync_s"), ("page cache only", "nosync_s",
                                                                                   "torch_s")):
            ratio = figures[torch_key] / figures[dcp_key]
            print(f"{label:16s} dcp.save {figures[dcp_key]:.3f} s {mb / figures[dcp_key]:7.1f} MB/s | torch.save "
                  f"(rank 0) {figures[torch_key]:.3f} s {mb / figures[torch_key]:7.1f} MB/s | dcp/torch.save "
                  f"throughput {ratio:.2f} (target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})")
        fraction = figures["async_block_s"] / figures["sync_s"]
        print(f"async save, this rank's share staged in the call (meshrun's Checkpointer): blocks {figures['async_block_s']:.3f} s "
              f"= {fraction:.3f} of a sync save (target <= 0.05: {'met' if fraction <= 0.05 else 'NOT met'})")
        whole = figures["whole_block_s"] / figures["sync_s"]
        print(f"async save, the whole state staged in the call (DCP's DefaultStager): blocks "
              f"{figures['whole_block_s']:.3f} s = {whole:.3f} of a sync save")
        overlap = figures["overlap_block_s"] / figures["sync_s"]
        print(f"async save, staged beside the next step (DCP's async staging): the step took "
              f"{figures['overlap_block_s']:.3f} s longer than its {figures['step_s']:.3f} s "
              f"= {overlap:.3f} of a sync save")
        rec = _recovery(workdir, args.timeout)
        print(f"recovery: SIGKILL of one worker after step {rec['killed_after_step']} -> step "
              f"{rec['resumed_step']} done by the restarted group in {rec['recovery_s']:.2f} s "
              "(restart, rendezvous, resume from the step-10 checkpoint)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
