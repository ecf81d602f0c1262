"""What expert parallel puts on each rank and sends per step: `meshrun plan`'s expert figures.

    meshrun plan examples/configs/tiny-moe-ep2.toml --world 2
    ... expert parallel: 2 of 4 experts per ep rank, ...; all-to-all 0.50 MiB sent per rank per step

Under `parallel.ep` (meshrun.parallel.expert_parallel) each MoE block sends every routed slot
(token x top-k) whose expert lives on another ep rank there and back, in forward and again in
backward (the reverse all-to-alls): 4 x slots x dim x the activation's bytes x (ep - 1) / ep per
block, with a balanced router (each rank's tokens spread over the experts evenly). The per-rank
counts exchanged first (experts int64 values, forward only) are counted too. benchmarks/moe.py measures both.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ExpertPlan:
    ep: int
    experts: int
    expert_param_bytes: int
    """This rank's routed-expert weights between steps (FSDP's shard of its ep shard), fp32."""
    all_to_all_bytes: float
    """Bytes this rank sends to its ep peers per optimizer step (forward and backward)."""

    def describe(self) -> str:
        return (f"expert parallel: {self.experts // self.ep} of {self.experts} experts per ep rank, "
                f"{self.expert_param_bytes / 2**20:.3f} MiB of expert weights per rank; all-to-all "
                f"{self.all_to_all_bytes / 2**20:.3f} MiB sent per rank per step (balanced routing)")


def expert_plan(args, dims, *, batch_size: int, seq_len: int, grad_accum: int = 1, dtype: str = "fp32",
                param_dtype: str | None = None) -> ExpertPlan | None:
    """The figures of `args` (built-in ModelArgs) under resolved `dims`; None without ep or experts.

    batch_size: sequences per data-parallel rank per micro-step; the activations travel in
    `param_dtype` (FSDP's compute dtype; None = dtype)."""
    if not getattr(args, "experts", 0) or getattr(dims, "ep", 1) <= 1:
        return None
    ep = dims.ep
    moe_blocks = args.num_moe_layers
    blocks_here = -(-moe_blocks // dims.pp)  # the fullest pipeline stage's share (balanced split)
    per_expert = 3 * args.moe_hidden * args.dim  # w1, w2, w3
    efsdp = dims.dp_shard // ep
    param_bytes = blocks_here * -(-(args.experts // ep) // efsdp) * per_expert * 4  # FSDP pads dim 0
    slots = batch_size * seq_len * args.experts_per_token
    elem = DTYPE_BYTES[param_dtype or dtype]
    rows = 4 * slots * args.dim * elem * (ep - 1) / ep
    counts = args.experts * 8 * (ep - 1) / ep  # the counts' exchange: forward only
    return ExpertPlan(ep, args.experts, param_bytes, grad_accum * blocks_here * (rows + counts))
