"""The guide's way, as the baseline of benchmarks/goodput.py: plain torchrun, DDP, a DCP checkpoint every N steps.

    torchrun --nproc-per-node 2 --max-restarts 9 benchmarks/torchrun_dcp.py --run-dir /tmp/base --steps 400

What a user writes from the PyTorch DCP recipe: an `AppState` (Stateful) around model and
optimizer, `dcp.save` every `--interval` steps, `dcp.load` of the newest at start. It trains
meshrun's tiny model (the same shape as examples/configs/tiny.toml) on seeded random tokens,
and writes the step times (metrics.jsonl rows) and lifecycle events (events.jsonl) that
goodput.py reads for meshrun's runs too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.models.llama import ModelArgs, Transformer
from meshrun.runtime import events


class AppState(Stateful):
    """The recipe's wrapper: DCP calls state_dict()/load_state_dict() on it."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.step = model, optimizer, 0

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = state["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--interval", type=int, default=5, help="steps between DCP checkpoints")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    events.record(run_dir, "pg_ready", proc_start=events.process_start_time())
    model = DDP(Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259,
                                      max_seq_len=32), seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    app = AppState(model, optimizer)
    events.record(run_dir, "checkpointer_ready")
    events.record(run_dir, "resume_start")
    ckpts = sorted(p for p in run_dir.glob("ckpt/step-*") if (p / ".metadata").is_file())  # DCP writes it last
    if ckpts:
        dcp.load({"app": app}, checkpoint_id=str(ckpts[-1]))
    events.record(run_dir, "resumed", source="disk" if ckpts else None, step=app.step)
    metrics = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None  # noqa: SIM115 - lives with the process
    first = True
    while app.step < args.steps:
        gen = torch.Generator().manual_seed(app.step * world + rank)  # the data of a step, whoever runs it
        tokens = torch.randint(0, 259, (8, 33), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        app.step += 1
        if metrics is not None:
            metrics.write(json.dumps({"kind": "train", "step": app.step, "time": round(time.time(), 3)}) + "\n")
            metrics.flush()
        if app.step % args.interval == 0:
            dcp.save({"app": app}, checkpoint_id=str(run_dir / "ckpt" / f"step-{app.step:08d}"))
        if first:
            events.record(run_dir, "first_step", step=app.step)
            first = False
    del model, optimizer, app  # a clean gloo teardown: free DDP first, then barrier, then destroy
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
