"""The experts' compute in bf16 on CPU: grouped GEMM (torch._grouped_mm, what meshrun picks there)
against a loop over the experts (what it does elsewhere), forward and backward, one process.

    python benchmarks/moe_experts.py                 # tiny-moe's shape and a wider one; about 15 s here
    python benchmarks/moe_experts.py --repeats 20 --timeout 600

Both run on the same tokens and weights, interleaved (loop, grouped, loop, ...) so that a change
in the machine's load falls on both; printed per shape: the median milliseconds of each and the
ratio grouped / loop (below 1: grouped GEMM is faster), and whether their outputs and gradients
are bitwise equal (they are, on CPU with torch 2.13). A report, not a gate.
"""

from __future__ import annotations

import argparse
import faulthandler
import statistics
import time

import torch

from meshrun.models.moe import experts_by_grouped_gemm, experts_by_loop

SHAPES = {  # name: (tokens routed, dim, expert hidden, experts)
    "tiny-moe": (2 * 64 * 2, 64, 96, 4),
    "dim 256, 8 experts": (2 * 256 * 2, 256, 352, 8),
}


def _once(fn, x, weights, counts, grad) -> tuple[float, list[torch.Tensor]]:
    for t in (x, *weights):
        t.grad = None
    t0 = time.perf_counter()
    out = fn(x, *weights, counts)
    out.backward(grad)
    seconds = time.perf_counter() - t0
    return seconds, [out.detach(), x.grad, *(w.grad for w in weights)]


def measure(tokens: int, dim: int, hidden: int, experts: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(experts), tokens, replacement=True, generator=gen).bincount(
        minlength=experts)
    x = torch.randn(tokens, dim, generator=gen).bfloat16().requires_grad_()
    weights = [(torch.randn(experts, *shape, generator=gen) * dim ** -0.5).bfloat16().requires_grad_()
               for shape in ((hidden, dim), (dim, hidden), (hidden, dim))]
    grad = torch.randn(tokens, dim, generator=gen).bfloat16()
    times = {"loop": [], "grouped": []}
    results = {}
    for i in range(repeats + 1):  # the first round warms up
        for name, fn in (("loop", experts_by_loop), ("grouped", experts_by_grouped_gemm)):
            seconds, results[name] = _once(fn, x, weights, counts, grad)
            if i:
                times[name].append(seconds)
    equal = all(torch.equal(a, b) for a, b in zip(results["loop"], results["grouped"], strict=True))
    return {"loop_ms": 1e3 * statistics.median(times["loop"]),
            "grouped_ms": 1e3 * statistics.median(times["grouped"]), "bitwise": equal}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10, help="timed rounds of each; the median is printed")
    p.add_argument("--timeout", type=float, default=300, help="seconds in all; past it, where it was and exit 1")
    args = p.parse_args()
    faulthandler.dump_traceback_later(args.timeout, exit=True)  # bounded: no hang outlives it
    torch.set_num_threads(1)  # one core, as a rank on this machine has
    print(f"experts' forward + backward in bf16 on CPU, 1 thread, median of {args.repeats}")
    for name, shape in SHAPES.items():
        r = measure(*shape, repeats=args.repeats)
        print(f"{name:20s} loop {r['loop_ms']:8.2f} ms  grouped GEMM {r['grouped_ms']:8.2f} ms  "
              f"ratio {r['grouped_ms'] / r['loop_ms']:.2f}  bitwise equal: {r['bitwise']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
