"""Expert parallel: per-rank expert memory, tokens/s and the all-to-all's share and bytes, ep 1, 2 and 4 (CPU).

    python benchmarks/moe.py --quick          # a small MoE, 4 steps per run: ~1 min here
    python benchmarks/moe.py                  # dim 256, 8 experts, seq 256: a few minutes
    python benchmarks/moe.py --ep 1,2 --steps 6

A report, not a gate. Each ep runs in its own `run_distributed` launch of ep ranks (ep 1: one
fresh process), through the trainer's own path: `resolve_layout` (strategy fsdp, dp_shard = ep,
parallel.ep = ep), `build_layout` (meta build; experts sharded on dim 0 over ep, tokens sent by
all-to-all, meshrun.parallel.expert_parallel) and `layout_step`. The same per-rank batch in every
run (so ep N trains N times the tokens per step), fp32, AdamW. Printed per ep, from the most
loaded rank where it matters:
- expert MiB: this rank's routed-expert weights between steps, and its ratio to ep 1 (target
  1/ep); `plan` is `meshrun plan`'s figure (meshrun.plan.experts);
- tokens/s: the global batch's tokens over the median step (steps after the first);
- all-to-all share: the seconds spent in the all-to-alls of the step (each timed to its end, in
  forward and in backward's reverse ones) over the step's seconds, mean over the ranks;
- all-to-all MiB: the bytes this rank sent its ep peers in one step, measured from the split
  sizes of the calls (ExpertParallel's counters: forward, and backward's reverse all-to-alls
  send the same rows back), mean over the ranks, beside `meshrun plan`'s balanced-routing
  figure and their ratio (target within 10%).
On a 2-core machine ep 4 runs 4 processes on 2 cores: its tokens/s shows the oversubscription,
not the speed-up of a GPU per rank; the memory and byte columns are what this measures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from meshrun.models.llama import ModelArgs, Transformer
from meshrun.models.sizes import size_spec
from meshrun.parallel.expert_parallel import expert_modules
from meshrun.parallel.layout import build_layout
from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
from meshrun.plan.experts import expert_plan
from meshrun.plan.measure import local_bytes
from meshrun.testing import run_distributed
from meshrun.train.step import layout_step

MIB = 2**20
FULL = dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, experts=8, experts_per_token=2, moe_hidden=512,
            seq=256, batch=4, steps=5)
QUICK = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, experts=8, experts_per_token=2, moe_hidden=256,
             seq=128, batch=4, steps=4)
VOCAB = 512


class AllToAllTimer(TorchDispatchMode):
    """Seconds in the functional all-to-alls dispatched while entered (forward and backward),
    each waited for inside the timed span, so the span is the exchange itself."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        packet = getattr(func, "overloadpacket", None)
        name = getattr(packet, "_qualified_op_name", "")
        if name.startswith("_c10d_functional") and name.endswith("::all_to_all_single"):
            started = time.perf_counter()
            out = torch.ops._c10d_functional.wait_tensor(func(*args, **(kwargs or {})))
            self.seconds += time.perf_counter() - started
            return out
        return func(*args, **(kwargs or {}))


def _model_args(spec: dict) -> ModelArgs:
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "experts", "experts_per_token", "moe_hidden")
    return ModelArgs(**{**size_spec("tiny-moe"), **{k: spec[k] for k in keys}, "vocab_size": VOCAB,
                        "max_seq_len": spec["seq"], "shared_experts": 1})


def _options(ep: int, spec: dict) -> ParallelOptions:
    return ParallelOptions(strategy="fsdp", dp_replicate=1, dp_shard=-1, ep=ep, batch_size=spec["batch"],
                           seq_len=spec["seq"])


def run_one(spec: dict, ep: int) -> dict:
    """On every rank of one launch: spec["steps"] steps of ep; the first one not timed."""
    world = dist.get_world_size()
    args = _model_args(spec)
    resolved = resolve_layout(_options(ep, spec), world, ModelShape.from_args(args))
    with torch.device("meta"):
        model = Transformer(args)
    layout = build_layout(model, resolved, device=torch.device("cpu"), seed=0)
    part = layout.parts[0]
    optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-3)]
    gen = torch.Generator().manual_seed(1 + layout.dp_rank)
    tokens = torch.randint(0, VOCAB, (spec["batch"], spec["seq"] + 1), generator=gen)
    styles = [m.ep_style for m in expert_modules(part) if hasattr(m, "ep_style")]

    def batches():
        while True:
            yield tokens[:, :-1], tokens[:, 1:]

    it = batches()
    times, a2a, sent = [], [], []
    for _ in range(spec["steps"]):
        before = sum(s.rows_bytes + s.counts_bytes for s in styles)
        before_rows = sum(s.rows_bytes for s in styles)
        dist.barrier()
        started = time.perf_counter()
        with AllToAllTimer() as timer:
            layout_step(layout, optimizers, it, grad_accum=1, dtype="fp32", grad_clip=1.0)
        times.append(time.perf_counter() - started)
        a2a.append(timer.seconds)
        rows = sum(s.rows_bytes for s in styles) - before_rows
        total = sum(s.rows_bytes + s.counts_bytes for s in styles) - before
        sent.append(total + rows)  # backward's reverse all-to-alls send the forward's rows again
    experts = local_bytes([p for m in expert_modules(part) for p in m.parameters()])
    measured = range(1, len(times)) if len(times) > 1 else range(len(times))
    step = statistics.median(times[i] for i in measured)
    return {"experts": experts, "step": step, "share": statistics.mean(a2a[i] / times[i] for i in measured),
            "sent": statistics.mean(sent[i] for i in measured), "tokens": spec["batch"] * spec["seq"] * world}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller MoE, 4 steps per run (about a minute)")
    p.add_argument("--ep", default="1,2,4", help="comma-separated ep degrees, 1 first (the baseline)")
    p.add_argument("--steps", type=int, help="steps per run; the first is not timed")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch; its processes are stopped by pid")
    a = p.parse_args()
    spec = dict(QUICK if a.quick else FULL)
    if a.steps:
        spec["steps"] = a.steps
    eps = [int(x) for x in a.ep.split(",")]
    args = _model_args(spec)
    print(f"MoE: dim {args.dim}, {args.n_layers} MoE blocks, {args.experts} experts (top "
          f"{args.experts_per_token}, 1 shared, hidden {args.moe_hidden}); batch {spec['batch']} x seq "
          f"{spec['seq']} per rank, fp32; {spec['steps']} steps per run")
    header = (f"{'ep':>3} {'expert MiB':>11} {'x ep1':>6} {'plan MiB':>9} {'tokens/s':>9} {'a2a share':>10} "
              f"{'a2a MiB':>8} {'plan MiB':>9} {'ratio':>6}")
    print(header)
    base = None
    for ep in eps:
        ranks = run_distributed(run_one, world_size=ep, timeout=a.timeout, args=(spec, ep))
        dims = resolve_layout(_options(ep, spec), ep, ModelShape.from_args(args)).dims
        plan = expert_plan(args, dims, batch_size=spec["batch"], seq_len=spec["seq"])
        experts = max(r["experts"] for r in ranks)
        base = base or experts
        rate = ranks[0]["tokens"] / max(r["step"] for r in ranks)
        share = statistics.mean(r["share"] for r in ranks)
        sent = statistics.mean(r["sent"] for r in ranks)
        planned_mem = f"{plan.expert_param_bytes / MIB:9.3f}" if plan else f"{experts / MIB:9.3f}"
        planned_a2a = plan.all_to_all_bytes if plan else 0.0
        ratio = f"{sent / planned_a2a:6.3f}" if planned_a2a else f"{'-':>6}"
        print(f"{ep:3d} {experts / MIB:11.3f} {experts / base:6.3f} {planned_mem} {rate:9.0f} {share:10.3f} "
              f"{sent / MIB:8.3f} {planned_a2a / MIB:9.3f} {ratio}", flush=True)


if __name__ == "__main__":
    main()
