"""What context parallel's ring moves: the bytes a cp rank receives per training step.

    from meshrun.plan.ring import ring_bytes
    ring_bytes(get_size("small"), ParallelDims(1, 1, 1, 1, world_size=4, cp=4), batch_size=1, seq_len=8192)

Each attention call runs torch's ring (meshrun.parallel.context) over the cp ranks, in torch
2.13's default rotation (`_cp_options.rotate_method`: all-gather):
- forward: one all-gather of this rank's keys and values (K and V of seq_len / cp tokens,
  n_heads / tp heads: a model's grouped kv heads are repeated before attention), so a rank
  receives (cp - 1) such blocks, in the activation dtype;
- backward: the same all-gather again, and the gradients of K and V passed one step round the
  ring cp times, accumulated in fp32 (`_cp_options.convert_to_f32`);
- activation checkpointing recomputes the forward, and with it the forward's all-gather.
Per rank that is, for `blocks` decoder blocks on the fullest pipeline rank and B x seq_len
tokens per data-parallel rank (split into micro-batches or not: the total is the same):
    kv = 2 B (seq_len / cp) (n_heads / tp) head_dim
    bytes = blocks x kv x ((cp - 1) x elem x (2, or 3 with checkpointing) + cp x 4)
Received bytes; each rank sends as many. Measured by benchmarks/context_parallel.py (every
functional collective the step dispatches, counted by size).
"""

from __future__ import annotations

from meshrun.models.args import ModelArgs
from meshrun.parallel.dims import ParallelDims
from meshrun.plan.activations import dtype_bytes
from meshrun.plan.show import stage_block_ranges

ACCUMULATE_BYTES = 4  # the ring accumulates dK and dV in float32


def ring_bytes(args: ModelArgs, dims: ParallelDims, *, batch_size: int, seq_len: int, dtype: str = "fp32",
               activation_checkpointing: bool = False) -> int:
    """Bytes a cp rank receives in the ring per step of `batch_size` sequences (0 when cp is 1)."""
    if dims.cp <= 1:
        return 0
    blocks = [stop - start for start, stop in stage_block_ranges(args.n_layers, dims.pp)]
    kv = 2 * batch_size * (seq_len // dims.cp) * (args.n_heads // dims.tp) * args.head_dim
    gathers = 3 if activation_checkpointing else 2
    per_block = kv * ((dims.cp - 1) * dtype_bytes(dtype) * gathers + dims.cp * ACCUMULATE_BYTES)
    return max(blocks) * per_block
