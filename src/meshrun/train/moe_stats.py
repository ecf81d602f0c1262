"""After each optimizer step of a mixture-of-experts model: the expert loads of every rank, the
aux-loss-free bias update, and the figures logged in metrics.jsonl (meshrun.models.moe).

One all-reduce of a (MoE layers x (experts + 4)) table over the world, every step under
moe_balance='bias' (the bias needs the load of every rank, so each rank moves it the same way)
and on logging steps otherwise. Each rank fills the rows of the blocks it holds: data-parallel
and context-parallel ranks route different tokens through the same block (expert-parallel ranks
too: each routes its own tokens, wherever their experts live), and pipeline stages hold
different blocks, so the sum over the world is every layer's load over the global batch
(tensor parallel of experts is refused, parallel/rules.py). A dense model has no MoEStats:
nothing here runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshrun.models.moe import STATS, MoE, expert_compute, moe_metrics


class MoEStats:
    """This rank's MoE blocks, addressed by their place among every MoE block of the model."""

    def __init__(self, parts: list[nn.Module], args, forwards_per_step: int = 1, *, device_type: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.layer_ids = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
        self.local = {m.layer_id: m for part in parts for m in part.modules() if isinstance(m, MoE)}
        for block in self.local.values():
            block.forwards_per_step = forwards_per_step
        self.experts = args.experts
        self.update_bias = args.moe_balance == "bias"
        self.describe = (f"mixture of experts: {args.experts} experts (top {args.experts_per_token}, "
                         f"{args.shared_experts} shared) in {len(self.layer_ids)} of {args.n_layers} blocks, "
                         f"balance {args.moe_balance!r}; the experts compute as {expert_compute(device_type, dtype)} "
                         f"({device_type}, {str(dtype).removeprefix('torch.')})")

    @classmethod
    def of(cls, parts: list[nn.Module], args, forwards_per_step: int = 1, *, device_type: str = "cpu",
           dtype: torch.dtype = torch.float32) -> MoEStats | None:
        """None for a dense model (or one that is not the built-in decoder). `forwards_per_step`:
        each block's forwards per optimizer step (grad_accum x pipeline micro-batches), which
        divides the balance loss's gradient as the training loss is divided. `device_type` and
        `dtype` (the step's compute dtype) name how the experts compute (models.moe.expert_compute)."""
        if not getattr(args, "experts", 0):
            return None
        return cls(parts, args, forwards_per_step, device_type=device_type, dtype=dtype)

    def after_step(self, log_now: bool, device: torch.device, group=None) -> dict[str, float] | None:
        """Sum this step's totals over the ranks (on every rank, on the same steps), move the
        bias, and return the figures on logging steps (identical on every rank)."""
        rows = {lid: m.take_stats() for lid, m in self.local.items()}  # reset every step
        if not (self.update_bias or log_now):
            return None
        table = torch.zeros(len(self.layer_ids), self.experts + STATS, device=device)
        for row, lid in enumerate(self.layer_ids):
            if rows.get(lid) is not None:
                table[row] = rows[lid].to(device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
        if self.update_bias:
            for row, lid in enumerate(self.layer_ids):
                if lid in self.local:
                    self.local[lid].update_bias(table[row, : self.experts])
        return moe_metrics(table.cpu()) if log_now else None
