"""`meshrun plan --simulate --device` against published throughput: torchtitan's Llama runs.

    python benchmarks/plan_published.py            # every row: ~2-3 min of CPU here
    python benchmarks/plan_published.py --rows 1,2  # some rows

Each row is one `meshrun plan examples/configs/gpu-8b.toml --simulate ... --device D --json` in its own
process (bounded by --timeout), the model, world, local batch, sequence length and activation
checkpointing set as the published run had them, and the projected tokens/s per GPU is printed
beside the published figure with their ratio. Sources (torchtitan, read 2026-12):
- benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton H100s, 96 GB HBM2e at 500 W; 400 Gb/s
  per GPU between hosts), Tables 1, 3 and 4;
- benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (the same hosts): FSDP x TP 8 in bf16 with
  vanilla (not async) TP, the TP meshrun runs, and torch.compile;
- docs/performance.md, "Llama 3 performance numbers" (64 A100 80GB).
Where the published run used what meshrun does not model (torch.compile, float8 linears, selective
activation checkpointing), the row says so: the projection is eager bf16 with full activation
checkpointing (one more forward).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "gpu-8b.toml"

# (label, published tokens/s per GPU, source, what the published run had that the projection lacks,
#  meshrun plan arguments)
ROWS = [
    ("Llama 3.1 8B, FSDP 8, 8 x H100, local batch 2, seq 8192", 5762, "torchtitan H100 2024-12, Table 1 (FSDP)",
     "selective AC (the projection recomputes whole blocks)",
     ["--nnodes", "1", "--nproc-per-node", "8", "--device", "h100", "--set", "train.batch_size=2"]),
    ("Llama 3.1 8B, FSDP 128, 128 x H100, local batch 2, seq 8192", 5605, "torchtitan H100 2024-12, Table 3 (FSDP)",
     "selective AC",
     ["--nnodes", "16", "--nproc-per-node", "8", "--device", "h100", "--set", "train.batch_size=2"]),
    ("Llama 3.1 8B, FSDP 8, 8 x H100, + torch.compile", 6667, "torchtitan H100 2024-12, Table 1",
     "torch.compile, selective AC",
     ["--nnodes", "1", "--nproc-per-node", "8", "--device", "h100", "--set", "train.batch_size=2"]),
    ("Llama 3.1 70B, FSDP 32 x TP 8, 256 x H100, local batch 16, seq 8192", 829,
     "torchtitan H100 2024-12, Table 4 (2D)", "float8 linears and torch.compile (the projection: bf16, eager)",
     ["--nnodes", "32", "--nproc-per-node", "8", "--device", "h100", "--set", "model.name=70b",
      "--set", "parallel.tp=8", "--set", "parallel.sequence_parallel=true", "--set", "train.batch_size=16"]),
    ("Llama 3.1 70B, FSDP 32 x TP 8, 256 x H100, local batch 16, bf16, vanilla TP", 597,
     "torchtitan asyncTP H100 2025-06 (bf16, vanilla TP: 597.3)", "torch.compile (full AC, as the projection)",
     ["--nnodes", "32", "--nproc-per-node", "8", "--device", "h100", "--set", "model.name=70b",
      "--set", "parallel.tp=8", "--set", "parallel.sequence_parallel=true", "--set", "train.batch_size=16"]),
    ("Llama 3.1 8B, FSDP 8 x TP 8, 64 x H100, local batch 12, bf16, vanilla TP", 4378,
     "torchtitan asyncTP H100 2025-06 (bf16, vanilla TP)", "torch.compile, per-op selective AC",
     ["--nnodes", "8", "--nproc-per-node", "8", "--device", "h100", "--set", "parallel.tp=8",
      "--set", "parallel.sequence_parallel=true", "--set", "train.batch_size=12"]),
    ("Llama 3 8B, FSDP 64, 64 x A100, local batch 1, seq 8192", 2876, "torchtitan docs/performance.md",
     "selective AC",
     ["--nnodes", "8", "--nproc-per-node", "8", "--device", "a100", "--set", "train.batch_size=1"]),
    ("Llama 3 70B, FSDP 64, 64 x A100, local batch 1, seq 8192", 323, "torchtitan docs/performance.md", "",
     ["--nnodes", "8", "--nproc-per-node", "8", "--device", "a100", "--set", "model.name=70b",
      "--set", "train.batch_size=1"]),
]
COMMON = ["--set", "train.grad_accum=1", "--set", "data.seq_len=8192", "--set", "train.activation_checkpointing=true"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="", help="comma-separated row numbers (1-based); default: all")
    p.add_argument("--timeout", type=float, default=600, help="seconds per row (default 600)")
    a = p.parse_args()
    chosen = [int(r) for r in a.rows.split(",") if r.strip()] or list(range(1, len(ROWS) + 1))
    meshrun = Path(sys.executable).with_name("meshrun")
    print("| # | published run | published tokens/s/GPU | projected | projected / published | simulated in | "
          "not modelled |")
    print("|---|---|---:|---:|---:|---:|---|")
    for i in chosen:
        label, published, source, lacks, args = ROWS[i - 1]
        cmd = [str(meshrun), "plan", str(CONFIG), "--simulate", *args, *COMMON, "--json"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=REPO)
        except subprocess.TimeoutExpired:  # subprocess.run kills the child (by its pid) before raising
            print(f"| {i} | {label} | {published:,} | timed out after {a.timeout:.0f} s | | | |")
            continue
        if done.returncode != 0:
            print(f"| {i} | {label} | {published:,} | failed: {done.stderr.strip().splitlines()[-1:]} | | | |")
            continue
        data = json.loads(done.stdout)
        proj = data["projection"]
        tokens = proj["tokens_per_s_per_gpu"]
        print(f"| {i} | {label} ({source}) | {published:,} | {tokens:,.0f} (MFU {proj['mfu']:.1%}, compute "
              f"{proj['compute_s']:.2f} s + exposed comm {proj['exposed_s']:.2f} s) | {tokens / published:.2f} | "
              f"{data['seconds']:.0f} s | {lacks} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
