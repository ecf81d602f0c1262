"""Context parallel: peak activation memory per rank and step time, cp 1, 2 and 4 side by side (CPU).

    python benchmarks/context_parallel.py --quick        # seq 512 and 2048, a small model: ~1 min here
    python benchmarks/context_parallel.py                # seq 2048 and 8192, dim 256, 4 blocks: minutes
    python benchmarks/context_parallel.py --seq-lens 4096 --cp 1,2 --steps 2
    python benchmarks/context_parallel.py --seq-lens 2048 --budgets 8,0.5   # + the longest-fit rows

A report, not a gate. Each (sequence length, cp) pair runs in its own `run_distributed` launch of
cp ranks (cp 1 too: one fresh process, like the others), through the trainer's own path: `resolve_layout` (strategy fsdp, parallel.cp = N), `build_layout` (meta build, FSDP over dp_shard x cp) and `layout_step`
(each rank's head-tail share of the sequence, attention as torch's ring around the CPU flash
kernel; meshrun.parallel.context). One sequence per step (batch 1), fp32, AdamW. Printed per
row, from the most-loaded rank:
- activations: the peak bytes autograd held saved for backward in the last step
  (`meshrun.plan.measure.SavedActivations`), and `meshrun plan`'s estimate of it;
- step: median wall seconds of the steps after the first (includes waiting on the ring's peers).
- ring: the bytes the most-loaded rank received in the ring's collectives in the measured step
  (`meshrun.plan.measure.Collectives`: what the functional collectives dispatched in it brought in),
  and `meshrun plan`'s count of them (meshrun.plan.ring).
Every figure is also given as a ratio to cp 1 at the same sequence length. On a 2-core machine
cp 4 runs 4 processes on 2 cores, so its step time shows the oversubscription, not the speed-up
a GPU per rank gives; the memory column is what context parallel is for.

Then, per memory budget of `--budgets` (GiB per rank) and per cp, the longest sequence (a
multiple of 256 x cp) whose `meshrun plan` total per rank (parameters, gradients, AdamW state,
activations) fits the budget: what cp buys in context length. Budgets up to `--measure-up-to`
GiB are also run at that length: the measured peak per rank (state + activations saved for
backward) and the tokens per second of the replica (one sequence per step over its cp ranks).
Larger budgets are planned only: 8 GiB per rank means sequences of ~10^5 tokens for this model,
hours of CPU per step on a 2-core machine; the plan is the figure (it matches the measured
activations within 0.5% in the rows above and in tests/e2e/test_parallel_matrix.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.layout import build_layout
from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
from meshrun.plan import estimate
from meshrun.plan.measure import Collectives, SavedActivations, local_bytes
from meshrun.testing import run_distributed
from meshrun.train.step import layout_step

MIB = 2**20
FULL = dict(seq_lens="2048,8192", dim=256, n_layers=4, n_heads=8, steps=3)
QUICK = dict(seq_lens="512,2048", dim=128, n_layers=2, n_heads=4, steps=3)


def _options(cp: int, seq: int) -> ParallelOptions:
    return ParallelOptions(strategy="fsdp", dp_replicate=1, dp_shard=1, cp=cp, batch_size=1, seq_len=seq)


def run_one(model_args: dict, cp: int, seq: int, steps: int, with_state: bool = False) -> dict:
    """On every rank of one launch: `steps` steps of the layout; the last one measured (and, with
    `with_state`, this rank's resident parameter, gradient and optimizer bytes after it)."""
    world = dist.get_world_size()
    args = ModelArgs(**model_args)
    resolved = resolve_layout(_options(cp, seq), world, ModelShape.from_args(args))
    with torch.device("meta"):
        model = Transformer(args)
    layout = build_layout(model, resolved, device=torch.device("cpu"), seed=0)
    optimizers = [torch.optim.AdamW(layout.parts[0].parameters(), lr=1e-3)]
    tokens = torch.randint(0, args.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))

    def batches():
        while True:
            yield tokens[:, :-1], tokens[:, 1:]

    it = batches()
    times = []

    def state():
        return [*layout.parts[0].parameters(), *layout.parts[0].buffers()]

    for _ in range(steps):
        dist.barrier()
        started = time.perf_counter()
        with SavedActivations(state) as acts, Collectives() as ring:
            layout_step(layout, optimizers, it, grad_accum=1, dtype="fp32", grad_clip=1.0)
        times.append(time.perf_counter() - started)
    out = {"activations": acts.peak, "step": statistics.median(times[1:] or times), "ring": ring.received}
    if with_state:  # gradients are freed after each step: one of each parameter's size during it
        opt_state = [v for o in optimizers for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
        out["state"] = 2 * local_bytes(layout.parts[0].parameters()) + local_bytes(opt_state)
    return out


def longest_fit(model_args: dict, cp: int, budget: int) -> tuple[int, int]:
    """(seq, planned bytes per rank): the longest multiple of 256 x cp whose plan fits `budget`."""
    step = 256 * cp

    def planned(seq: int) -> int:
        args = ModelArgs(**{**model_args, "max_seq_len": seq})
        dims = resolve_layout(_options(cp, seq), cp).dims
        return estimate(args, dims, batch_size=1, seq_len=seq).total

    if planned(step) > budget:
        return 0, planned(step)
    low, high = 1, 2
    while planned(high * step) <= budget:  # total grows with seq: double, then bisect
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if planned(mid * step) <= budget else (low, mid)
    return low * step, planned(low * step)


def fit_rows(model_args: dict, cps: list[int], budgets: list[float], measure_up_to: float, steps: int,
             timeout: float, env: dict) -> None:
    print(f"\nlongest sequence per rank budget (plan: params + grads + AdamW + activations; "
          f"measured up to {measure_up_to:g} GiB)")
    print(f"{'GiB':>6} {'cp':>3} {'seq':>7} {'x cp1':>6} {'plan MiB':>9} {'measured MiB':>13} {'tokens/s':>9} {'x cp1':>6}")
    for budget in budgets:
        first = None
        for cp in cps:
            seq, planned = longest_fit(model_args, cp, int(budget * 2**30))
            if not seq:
                print(f"{budget:6g} {cp:3d} {'none fits':>7}")
                continue
            measured, rate = "-", None
            if budget <= measure_up_to:
                per_rank = run_distributed(run_one, world_size=cp, timeout=timeout,
                                           args=({**model_args, "max_seq_len": seq}, cp, seq, steps, True), env=env)
                peak = max(r["activations"] + r["state"] for r in per_rank)
                rate = seq / max(r["step"] for r in per_rank)
                measured = f"{peak / MIB:.1f}"
            first = first or (seq, rate)
            ratio = f"{rate / first[1]:6.2f}" if rate and first[1] else f"{'-':>6}"
            print(f"{budget:6g} {cp:3d} {seq:7d} {seq / first[0]:6.2f} {planned / MIB:9.1f} {measured:>13} "
                  f"{(f'{rate:.0f}' if rate else '-'):>9} {ratio}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="seq 512 and 2048 with a smaller model (about a minute)")
    p.add_argument("--seq-lens", help=f"comma-separated sequence lengths (default {FULL['seq_lens']}; "
                                      f"--quick {QUICK['seq_lens']})")
    p.add_argument("--cp", default="1,2,4", help="comma-separated cp degrees, 1 first (the baseline)")
    p.add_argument("--dim", type=int)
    p.add_argument("--n-layers", type=int)
    p.add_argument("--n-heads", type=int)
    p.add_argument("--steps", type=int, help="steps per run; the first is not timed (default 3)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--budgets", default="8,0.5",
                   help="comma-separated GiB per rank: the longest sequence each cp fits in (default 8,0.5; '' = none)")
    p.add_argument("--measure-up-to", type=float, default=1.0,
                   help="GiB: budgets up to this are also run at their longest sequence (default 1)")
    a = p.parse_args()
    base = QUICK if a.quick else FULL
    seq_lens = [int(s) for s in (a.seq_lens or base["seq_lens"]).split(",")]
    cps = [int(c) for c in a.cp.split(",")]
    dim, n_layers = a.dim or base["dim"], a.n_layers or base["n_layers"]
    n_heads, steps = a.n_heads or base["n_heads"], a.steps or base["steps"]
    model_args = dict(vocab_size=256, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
                      max_seq_len=max(seq_lens))
    for seq in seq_lens:  # a bad layout fails here, in one line, before any launch
        for cp in cps:
            resolve_layout(_options(cp, seq), cp, ModelShape.from_args(ModelArgs(**model_args)))
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"dim {dim}, {n_layers} blocks, {n_heads} heads, vocab 256, batch 1, fp32, AdamW, CPU/gloo, "
          f"torch {torch.__version__}; {steps} steps per run (median of all but the first)")
    print(f"{'seq':>6} {'cp':>3} {'activations MiB':>16} {'x cp1':>6} {'plan MiB':>9} {'step s':>8} {'x cp1':>6} "
          f"{'ring MiB':>9} {'plan MiB':>9}")
    for seq in seq_lens:
        first = None
        for cp in cps:
            per_rank = run_distributed(run_one, world_size=cp, timeout=a.timeout,
                                       args=(model_args, cp, seq, steps), env=env)
            result = {key: max(r[key] for r in per_rank) for key in ("activations", "step", "ring")}
            first = first or result
            resolved = resolve_layout(_options(cp, seq), cp)
            planned = estimate(ModelArgs(**model_args), resolved.dims, batch_size=1, seq_len=seq)
            print(f"{seq:6d} {cp:3d} {result['activations'] / MIB:16.1f} "
                  f"{result['activations'] / first['activations']:6.2f} {planned.activations / MIB:9.1f} "
                  f"{result['step']:8.3f} {result['step'] / first['step']:6.2f} "
                  f"{result['ring'] / MIB:9.1f} {planned.ring / MIB:9.1f}", flush=True)
    budgets = [float(b) for b in a.budgets.split(",") if b.strip()]
    if budgets:
        fit_rows(model_args, cps, budgets, a.measure_up_to, steps, a.timeout, env)


if __name__ == "__main__":
    main()
