"""train.compile's speed-up: tokens/s of eager vs compiled training, tiny and small, 1 and 2 processes.

    python benchmarks/compile_speedup.py                        # tiny+small x {1 proc, DDP 2, FSDP 2}
    python benchmarks/compile_speedup.py --sizes tiny --layouts ddp2 --variants eager,compile,blocks,whole

A report, not a gate. Each (size, layout) is one `run_distributed` launch whose ranks build one
model per variant from the same seed and then train them in turn, one step each round (so
machine noise hits every variant alike), on the same fixed batches, for --steps steps. A
variant is a base joined by "+" to any modifiers:
- eager: meshrun without train.compile, its default optimizer (`optim` defaults: AdamW with
  `implementation = "auto"`, fused on CPU; built by meshrun.train.optimizers.build_optimizer);
- compile: what `train.compile = true` does (meshrun.parallel.compile.apply_compile): the whole
  model in one graph where the layout allows it (1 process, DDP), else block by block (FSDP);
- blocks / whole: each block compiled on its own / the whole model in one graph, forced;
- graphs: the whole model with graph breaks allowed (fullgraph=False); under FSDP dynamo skips
  the model's forward (a graph break, at FSDP's hooks, inside its loop over the blocks) and
  compiles each block's forward: the same graphs as `blocks`;
- +foreach: AdamW with torch's foreach step instead of the fused one (the old baseline);
- +loss: the cross entropy (with its fp32 cast) compiled on its own;
- +cpp: inductor's C++ wrapper (`cpp_wrapper`) instead of its Python one;
- +bf16: under bf16 autocast (fast only where the CPU has AVX-512 BF16 or AMX);
- +keep: FSDP keeps each block's gathered parameters from forward to backward
  (`parallel.fsdp_reshard_after_forward = false`: one all-gather per block a step, not two);
- +norm: the last norm compiled as a graph of its own (under FSDP only the blocks are);
- +opt: the optimizer step compiled (torch.compile of `opt.step`, on DTensor parameters under FSDP);
- +ca: compiled autograd around forward and backward (torch._dynamo's compiled_autograd), with
  FSDP2's end-of-backward callback run by hand (`_finish_fsdp_backward`).
Prints, per variant: median tokens/s over the steps after --warmup (all ranks' tokens), the
ratio to the first variant (eager), eager's CPU seconds a step (all ranks' process time) over
the variant's (a ratio that a loaded machine's waiting does not move; collectives' waits and
spinning count as they are), the compile time (the first step's seconds, compiling
included), and the largest loss difference from eager over the run. The inductor cache is a
fresh temporary directory shared by every launch of this run (the layouts then share graphs),
unless TORCHINDUCTOR_CACHE_DIR is set. Each launch is bounded by --timeout and its ranks are
killed by pid by run_distributed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshrun.config import OptimSection
from meshrun.models.args import ModelArgs
from meshrun.models.llama import Transformer
from meshrun.models.sizes import SIZES
from meshrun.parallel.compile import apply_compile
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.parallelize import clip_grad_norm_, parallelize_nd
from meshrun.testing import run_distributed
from meshrun.train.optimizers import build_optimizer

LAYOUTS = {"1proc": dict(), "ddp2": dict(dp_replicate=2), "fsdp2": dict(dp_shard=2)}
BASES = {"eager": None, "compile": "auto", "blocks": "blocks", "whole": "whole", "graphs": "graphs"}
MODIFIERS = ("foreach", "loss", "cpp", "bf16", "keep", "norm", "opt", "ca")


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # meshrun.train.step.lm_loss


def check_variant(variant: str) -> None:
    base, *mods = variant.split("+")
    if base not in BASES or any(m not in MODIFIERS for m in mods):
        raise SystemExit(f"--variants: {variant!r} is not a base ({', '.join(BASES)}) with modifiers "
                         f"({', '.join(MODIFIERS)}) joined by '+'")


def _build(variant: str, size: str, layout: dict, seq: int):
    base, *mods = variant.split("+")
    args = ModelArgs(**{**SIZES[size], "max_seq_len": max(seq, SIZES[size]["max_seq_len"])})
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = Transformer(args, seed=0)
    mesh, dims = None, None
    scope = BASES[base]
    options = {"cpp_wrapper": True} if "cpp" in mods else None

    def compile_(m):
        if scope == "graphs":  # dynamo splits the graph where it must (under FSDP: at its hooks)
            m._compiled_call_impl = torch.compile(m._call_impl, fullgraph=False, options=options)
        elif scope is not None:
            apply_compile(m, True, scope=scope, options=options)
        if "norm" in mods:  # a function of this file: dynamo skips a torch.nn frame at the top
            norm = m.norm
            norm._compiled_call_impl = torch.compile(lambda *a: norm._call_impl(*a), fullgraph=True)

    if world > 1:
        dims = ParallelDims(dp_replicate=layout.get("dp_replicate", 1), dp_shard=layout.get("dp_shard", 1),
                            tp=1, pp=1, world_size=world)
        mesh = dims.build_mesh("cpu")
        model = parallelize_nd(model, dims, mesh, device=torch.device("cpu"), materialize=compile_,
                               reshard_after_forward="keep" not in mods)
    else:
        compile_(model)
    opt = build_optimizer(model, OptimSection(implementation="foreach" if "foreach" in mods else "auto"))
    loss_fn = torch.compile(_loss, fullgraph=True) if "loss" in mods else _loss
    if "opt" in mods:
        opt.step = torch.compile(opt.step, fullgraph=False)
    dp_rank = dims.dp_rank(mesh) if dims else 0
    return model, opt, loss_fn, dp_rank, (dims.dp_size if dims else 1)


def _step(model, opt, loss_fn, x, y, bf16: bool, ca: bool = False) -> tuple[float, float, float]:
    from torch._dynamo.utils import maybe_enable_compiled_autograd

    started, cpu = time.perf_counter(), time.process_time()
    with maybe_enable_compiled_autograd(ca, fullgraph=False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        loss.backward()
    if ca:
        _finish_fsdp_backward(model)
    clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = loss.detach()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return time.perf_counter() - started, time.process_time() - cpu, float(value)


def _finish_fsdp_backward(model) -> None:
    """Run FSDP2's end-of-backward callback where compiled autograd dropped it (torch 2.13).

    FSDP2 queues it with the autograd engine's queue_callback from a hook that dynamo must not
    trace; compiled autograd keeps only callbacks queued in traced code, so without this the
    root unit (embedding, last norm, head) is never reduce-scattered nor resharded.
    """
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    if state is not None and state._state_ctx.post_backward_final_callback_queued:
        state._root_post_backward_final_callback()


def run(size: str, layout: dict, variants: list[str], batch: int, seq: int, steps: int) -> dict:
    built = {v: _build(v, size, layout, seq) for v in variants}
    gen = torch.Generator().manual_seed(0)
    vocab = SIZES[size]["vocab_size"]
    tokens = torch.randint(0, vocab, (steps, batch, seq + 1), generator=gen)
    out = {v: {"times": [], "cpu": [], "losses": []} for v in variants}
    for step in range(steps):
        for v in variants:
            model, opt, loss_fn, dp_rank, dp_size = built[v]
            per = batch // dp_size
            rows = tokens[step, dp_rank * per:(dp_rank + 1) * per]
            if dist.is_initialized():
                dist.barrier()
            seconds, cpu, loss = _step(model, opt, loss_fn, rows[:, :-1], rows[:, 1:], "+bf16" in v, "+ca" in v)
            out[v]["times"].append(seconds)
            out[v]["cpu"].append(cpu)
            out[v]["losses"].append(loss)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,small")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--variants", default="eager,compile,eager+foreach,compile+foreach",
                   help=f"comma-separated, 'eager' first: a base ({', '.join(BASES)}) and modifiers "
                        f"({', '.join(MODIFIERS)}) joined by '+'")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians (the first compiles)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    args = p.parse_args()
    variants = args.variants.split(",")
    assert variants[0] == "eager", "the first variant is the baseline: eager"
    for v in variants:
        check_variant(v)
    cache = None
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        cache = tempfile.TemporaryDirectory(prefix="compile-bench-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    print(f"load average {_load()} on {os.cpu_count()} cores; {args.steps} steps, "
          f"global batch {args.batch_size} x {args.seq_len}, cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
    for size in args.sizes.split(","):
        for name in args.layouts.split(","):
            layout = LAYOUTS[name]
            world = max(1, layout.get("dp_replicate", 1) * layout.get("dp_shard", 1))
            fn_args = (size, layout, variants, args.batch_size, args.seq_len, args.steps)
            if world == 1:
                torch.set_num_threads(1)  # as each launched worker runs (OMP_NUM_THREADS=1)
                results = [run(*fn_args)]
            else:
                results = run_distributed(run, world_size=world, args=fn_args, timeout=args.timeout,
                                          env={"OMP_NUM_THREADS": "1"})
            _report(size, name, variants, results, args)
            print(f"  (load average now {_load()})", flush=True)
    if cache is not None:
        cache.cleanup()


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _report(size: str, layout: str, variants: list[str], results: list[dict], args) -> None:
    tokens = args.batch_size * args.seq_len

    def tokens_per_s(v: str) -> float:  # the slowest rank's step sets the pace
        per_step = [max(r[v]["times"][i] for r in results) for i in range(args.warmup, args.steps)]
        return tokens / statistics.median(per_step)

    def cpu_s(v: str) -> float:  # CPU seconds a step, summed over ranks: what load does not inflate
        return statistics.median(sum(r[v]["cpu"][i] for r in results) for i in range(args.warmup, args.steps))

    base, base_cpu = tokens_per_s("eager"), cpu_s("eager")
    eager_losses = results[0]["eager"]["losses"]
    for v in variants:
        rate = tokens_per_s(v)
        first = max(r[v]["times"][0] for r in results)
        diff = max(abs(a - b) for a, b in zip(results[0][v]["losses"], eager_losses, strict=True))
        print(f"{size:5s} {layout:6s} {v:14s} {rate:9.0f} tok/s  {rate / base:5.2f}x eager  "
              f"CPU {base_cpu / cpu_s(v):5.2f}x  "
              f"first step {first:6.1f} s  max |loss - eager| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
