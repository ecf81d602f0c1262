"""LoRA against full fine-tuning on the same model: optimizer-state and gradient bytes, and step time.

    python benchmarks/lora_memory.py                       # the built-in "base" size (126M), rank 8, fp32; ~2 min
    python benchmarks/lora_memory.py --model small --batch-size 4 --steps 8   # 12.8M: ~30 s

Both runs build the same model from the same seed in this process and train it with meshrun's
own optimizer (`build_optimizer`: AdamW over the trainable parameters) on the same random batch.
Full fine-tuning trains every weight; LoRA (models/lora.py, through peft) freezes the base (in
bf16 with --dtype bf16, as `meshrun train` does) and trains adapters on the attention and MLP
projections. Bytes are counted after the first step: every tensor of the optimizer's state, and
every parameter's gradient. The step time is the median of --steps timed steps (forward,
backward, optimizer step) after --warmup, the two runs' steps alternating (a change in the
machine's load meets both alike), as wall time and as this process's CPU time (the target
is judged on the CPU time: with --threads 1 it is the compute, whatever else the machine runs).
Targets: optimizer state <= 5% of full, step <= 0.8x.

The default is the "base" size, a model one fine-tunes: LoRA saves the weight gradients' matmuls
and the optimizer, while attention, norms, activations and the input gradients cost both runs the
same, and the smaller the model the larger that shared part. Measured here (2 cores, 1 thread,
fp32, the steps alternating): base (126M, batch 2 x 128) 0.70x; small (12.8M, batch 4 x 128)
0.83-0.89x, over the target.
The whole run is bounded by --timeout (seconds).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from meshrun.config.lora_section import LoraSection
from meshrun.config.sections import OptimSection
from meshrun.models.factory import build_model
from meshrun.models.lora import apply_lora, init_adapters
from meshrun.train.optimizers import build_optimizer
from meshrun.train.precision import autocast_context

VOCAB = 256
TARGET_OPTIM_SHARE = 0.05
TARGET_STEP_RATIO = 0.8


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def build(args, lora: bool):
    """One fine-tuning run's model and optimizer, from the same seed."""
    torch.manual_seed(0)
    model = build_model(SimpleNamespace(name=args.model), VOCAB, seed=0)
    if lora:
        base_dtype = torch.bfloat16 if args.dtype == "bf16" else None
        model = apply_lora(model, LoraSection(rank=args.rank, alpha=2.0 * args.rank), base_dtype=base_dtype)
        init_adapters([model], 0)
    return model, build_optimizer(model, OptimSection(lr=1e-4))


def step(args, model, optimizer, inputs, targets, figures: dict | None = None) -> tuple[float, float]:
    """One step (forward, backward, optimizer step): its wall and CPU seconds; `figures` gets the
    gradient and optimizer-state bytes when given (the first step)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    with autocast_context(torch.device("cpu"), args.dtype):
        logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    if figures is not None:
        figures["grad_bytes"] = _tensor_bytes(p.grad for p in model.parameters())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if figures is not None:
        figures["optim_bytes"] = _tensor_bytes(v for state in optimizer.state.values() for v in state.values())
    return time.perf_counter() - started, time.process_time() - cpu_started


def measure(args) -> tuple[dict, dict]:
    """Both runs' bytes after the first step and median step times. The timed steps alternate
    (full, LoRA, LoRA, full, ...): a change in the machine's load meets both runs alike."""
    tokens = torch.randint(0, VOCAB, (args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    runs = {"full": build(args, lora=False), "lora": build(args, lora=True)}
    figures = {name: {} for name in runs}
    times = {name: ([], []) for name in runs}
    for name, (model, optimizer) in runs.items():
        for i in range(max(args.warmup, 1)):
            step(args, model, optimizer, inputs, targets, figures[name] if i == 0 else None)
    for i in range(args.steps):
        for name in (("full", "lora") if i % 2 == 0 else ("lora", "full")):
            wall, cpu = step(args, *runs[name], inputs, targets)
            times[name][0].append(wall)
            times[name][1].append(cpu)
    for name, (model, _) in runs.items():
        figures[name]["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        figures[name]["params"] = sum(p.numel() for p in model.parameters())
        figures[name]["step_s"] = statistics.median(times[name][0])
        figures[name]["step_cpu_s"] = statistics.median(times[name][1])
    return figures["full"], figures["lora"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="base", help="a built-in size (tiny, small, base, ...)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (lora.rank)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                        help="train.dtype: bf16 runs under autocast and stores LoRA's frozen base in bf16")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (the runs alternate)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: as each rank of a run)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds for the whole benchmark; 0 = none")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.timeout > 0:
        signal.signal(signal.SIGALRM, lambda *_: sys.exit(f"lora_memory: timed out after {args.timeout} s"))
        signal.alarm(args.timeout)
    full, lora = measure(args)
    print(f"model {args.model}: {full['params'] / 1e6:.2f}M parameters, LoRA rank {args.rank} trains "
          f"{lora['trainable'] / 1e6:.3f}M; dtype {args.dtype}, batch {args.batch_size} x {args.seq_len}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'':<18}{'full':>14}{'lora':>14}{'lora / full':>14}")
    rows = (("optimizer state", "optim_bytes", 1 / 2**20, "MiB"), ("gradients", "grad_bytes", 1 / 2**20, "MiB"),
            ("step time (wall)", "step_s", 1e3, "ms"), ("step time (CPU)", "step_cpu_s", 1e3, "ms"))
    for label, key, scale, unit in rows:
        print(f"{label:<18}{full[key] * scale:>10.2f} {unit:<3}{lora[key] * scale:>10.2f} {unit:<3}"
              f"{lora[key] / full[key]:>13.3f}x")
    # The step is judged on this process's CPU time: with one thread it is the compute, and other
    # processes on a shared machine do not change it (the wall time is printed beside it).
    optim_share, step_ratio = lora["optim_bytes"] / full["optim_bytes"], lora["step_cpu_s"] / full["step_cpu_s"]
    ok = optim_share <= TARGET_OPTIM_SHARE and step_ratio <= TARGET_STEP_RATIO
    print(f"targets: optimizer state <= {TARGET_OPTIM_SHARE:.0%} of full ({optim_share:.2%}), "
          f"step <= {TARGET_STEP_RATIO}x full ({step_ratio:.2f}x): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
