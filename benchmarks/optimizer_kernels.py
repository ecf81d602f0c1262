"""Optimizer step time per kernel (for-loop, foreach, fused) on the built-in models' parameters.

    python benchmarks/optimizer_kernels.py --models tiny,small --steps 30

Gradients are random and fixed; only `optimizer.step()` is timed (median of `--steps` after
`--warmup`). Prints each kernel's median and its speed-up over the for-loop baseline of the same
optimizer, measured in the same run. `optim.implementation = "auto"` picks fused where it exists.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from meshrun.models.factory import build_model
from meshrun.train.optimizers import build_optimizer

KERNELS = ("for-loop", "foreach", "fused")
OPTIMIZERS = ("adamw", "adam", "sgd")


def _median_step_s(model: torch.nn.Module, name: str, kernel: str, steps: int, warmup: int) -> float:
    cfg = SimpleNamespace(name=name, lr=1e-4, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                          momentum=0.9, nesterov=False, implementation=kernel)
    optimizer = build_optimizer(model, cfg)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    times = []
    for i in range(warmup + steps):
        started = time.perf_counter()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small", help="built-in sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per kernel")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    args = parser.parse_args()
    for size in args.models.split(","):
        model = build_model(SimpleNamespace(name=size), 256, seed=0)
        numel = sum(p.numel() for p in model.parameters())
        print(f"{size}: {numel / 1e6:.2f}M parameters, {torch.get_num_threads()} threads")
        for name in OPTIMIZERS:
            base = _median_step_s(model, name, "for-loop", args.steps, args.warmup)
            row = [f"{k} {t * 1e3:.2f} ms ({base / t:.2f}x)" for k in KERNELS
                   for t in [base if k == "for-loop" else _median_step_s(model, name, k, args.steps, args.warmup)]]
            print(f"  {name:<6} " + ", ".join(row))


if __name__ == "__main__":
    main()
