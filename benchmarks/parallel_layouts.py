"""Step time and per-rank memory of each N-D layout, relative to DDP at the same world size (CPU).

    python benchmarks/parallel_layouts.py                  # world 4, the tiny model, ~3 min here
    python benchmarks/parallel_layouts.py --steps 20 --dim 256 --layouts ddp4,fsdp4,pp2_fsdp2

A report, not a gate. Each layout runs in its own `run_distributed` launch (so peak RSS is its
own), resolves it with `resolve_layout` (the call `meshrun train` makes), trains the built-in
Transformer through meshrun's parallelize_nd / parallelize_pipeline and train_step /
train_step_pp on a fixed global batch, and reports, from the slowest rank:
- step: median wall seconds of the steps after --warmup (includes waiting on peers);
- state: the most-loaded rank's local bytes of params + grads + AdamW state (DTensor shards by
  `to_local()`), what `meshrun plan` estimates;
- rss: the largest rank's peak resident set size (the process, torch itself included: on CPU
  there is no allocator counter, so small models mostly show torch's own ~300 MB).
Every figure is also printed as a ratio to the DDP layout of the same world size.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.parallelize import parallelize_nd, parallelize_pipeline
from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
from meshrun.plan.measure import local_bytes
from meshrun.testing import run_distributed
from meshrun.train.step import train_step, train_step_pp

# [parallel] keys of each layout (ParallelOptions); the degrees left out are 1.
LAYOUTS = {
    "ddp4": dict(strategy="ddp", dp_replicate=4),
    "fsdp4": dict(dp_shard=4),
    "hsdp2x2": dict(dp_replicate=2, dp_shard=2),
    "tp2_dp2": dict(dp_replicate=2, tp=2),
    "tp4": dict(tp=4),
    "fsdp2_tp2": dict(dp_shard=2, tp=2),
    "pp2_gpipe_dp2": dict(pp=2, dp_replicate=2, pp_schedule="gpipe"),
    "pp2_1f1b_dp2": dict(pp=2, dp_replicate=2, pp_schedule="1f1b"),
    "pp2_interleaved_1f1b_dp2": dict(pp=2, dp_replicate=2, pp_schedule="interleaved_1f1b"),
    "pp2_fsdp2": dict(pp=2, dp_shard=2, pp_schedule="1f1b"),
    "pp2_tp2": dict(pp=2, tp=2, pp_schedule="1f1b"),
}


def options_for(layout: dict, global_batch: int) -> ParallelOptions:
    """The layout's ParallelOptions (strategy fsdp unless it says ddp), with the per-dp-rank batch."""
    keys = {"strategy": "fsdp", "dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **layout}
    dp_size = keys["dp_replicate"] * keys["dp_shard"]
    return ParallelOptions(**keys, batch_size=global_batch // dp_size)


def run_layout(layout: dict, model_args: dict, batch: int, seq: int, steps: int, warmup: int) -> dict:
    args = ModelArgs(**model_args)
    resolved = resolve_layout(options_for(layout, batch), dist.get_world_size(),
                              ModelShape.from_args(args))
    dims, options = resolved.dims, resolved.options
    cpu = torch.device("cpu")
    model = Transformer(args, seed=0)
    mesh = dims.build_mesh("cpu")
    pipeline = None
    if resolved.pipeline is not None:
        pipeline = parallelize_pipeline(model, dims, mesh, resolved.pipeline, device=cpu)
        parts = pipeline.parts
    else:
        parts = [parallelize_nd(model, dims, mesh, device=cpu,
                                sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel)]
    del model
    optimizers = [torch.optim.AdamW(p.parameters(), lr=1e-3) for p in parts]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_args["vocab_size"], (batch, seq + 1), generator=gen)
    per = batch // dims.dp_size
    rows = slice(dims.dp_rank(mesh) * per, (dims.dp_rank(mesh) + 1) * per)

    def batches():
        while True:
            yield tokens[rows, :-1], tokens[rows, 1:]

    it = batches()
    times = []
    state = 0
    for step in range(steps):
        dist.barrier()
        started = time.perf_counter()
        if pipeline is not None:
            train_step_pp(pipeline, optimizers, it, grad_accum=1, device=cpu, dtype="fp32", grad_clip=1.0,
                          pp_group=mesh["pp"].get_group())
        else:
            train_step(parts[0], optimizers[0], it, grad_accum=1, device=cpu, dtype="fp32", grad_clip=1.0)
        times.append(time.perf_counter() - started)
        if step == 0:
            params = [p for part in parts for p in part.parameters()]
            optim = [v for o in optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
            state = 2 * local_bytes(params) + local_bytes(optim)  # grads are shaped like params
    return {"step": statistics.median(times[warmup:]), "state": state,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names (first DDP is the baseline)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120, help="seconds per layout launch")
    args = p.parse_args()
    for name in args.layouts.split(","):  # a bad layout fails here, in one line, before any launch
        if name not in LAYOUTS:
            p.error(f"--layouts: unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
        resolve_layout(options_for(LAYOUTS[name], args.batch_size), 4,
                       ModelShape(n_heads=4, n_kv_heads=4, n_layers=args.n_layers))
    model_args = dict(vocab_size=256, dim=args.dim, n_layers=args.n_layers, n_heads=4, n_kv_heads=4,
                      max_seq_len=args.seq_len)
    results = {}
    for name in args.layouts.split(","):
        per_rank = run_distributed(run_layout, world_size=4, timeout=args.timeout,
                                   args=(LAYOUTS[name], model_args, args.batch_size, args.seq_len,
                                         args.steps, args.warmup),
                                   env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        results[name] = {key: max(r[key] for r in per_rank) for key in ("step", "state", "rss")}
        print(f"  {name}: done", flush=True)
    base = results.get("ddp4") or next(iter(results.values()))
    print(f"\nworld 4, dim {args.dim}, {args.n_layers} blocks, global batch {args.batch_size} x {args.seq_len}, "
          f"fp32, CPU/gloo; ratios vs ddp4")
    print(f"{'layout':28} {'step s':>8} {'x ddp':>6} {'state MiB':>10} {'x ddp':>6} {'rss MiB':>8} {'x ddp':>6}")
    for name, r in results.items():
        print(f"{name:28} {r['step']:8.4f} {r['step'] / base['step']:6.2f} {r['state'] / 2**20:10.2f} "
              f"{r['state'] / base['state']:6.2f} {r['rss'] / 2**20:8.0f} {r['rss'] / base['rss']:6.2f}")


if __name__ == "__main__":
    main()
