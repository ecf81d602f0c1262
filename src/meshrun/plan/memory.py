"""Per-rank memory of a training layout (params, grads, AdamW state, activations) and its ranking.

    from meshrun.plan import estimate, candidates
    est = estimate(get_size("small"), ParallelDims(1, 2, 2, 1, world_size=4), batch_size=8, seq_len=256)
    ranked = candidates(get_size("8b"), world_size=64, batch_size=1, seq_len=8192, device_memory=80 * 2**30)

What is counted, per rank, on the most-loaded rank (the largest shard, the fullest stage):
- params: fp32, since meshrun keeps fp32 weights and bf16 runs only autocast. Exact from the
  shapes and the placement rules in `meshrun.plan.show` (FSDP2 pads shards to equal size).
- grads: one fp32 gradient per parameter element, sharded like the parameter.
- optim: AdamW's exp_avg and exp_avg_sq (fp32, like the parameter) plus its 4-byte `step`
  tensor per parameter tensor (torch.optim.AdamW, non-capturable).
- fsdp_buffers: with dp_shard > 1, the all-gathered (unsharded) parameters of two blocks,
  the one computing and the one prefetched (FSDP2's default of one block ahead).
- activations: what autograd saves in forward for backward, for one micro-batch of
  ``batch_size`` x ``seq_len`` on each data-parallel rank, on the fullest pipeline stage.
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198), count sbh(34 + 5as/h) bytes per GPT layer for 16-bit activations with
  dropout and a 4h GELU MLP; adapted to this decoder (no dropout, a SwiGLU MLP of width f,
  grouped-query k/v of width h_kv, fused SDPA that keeps no s x s matrix) the saved elements
  per layer are  sb(7h + 3h_kv + 4f)  for what TP splits (q/k/v before and after RoPE, the
  repeated k/v, the attention output, the four f-wide MLP tensors) plus  4sbh  it does not
  (both norms' inputs and outputs), times the activation element size (4 for fp32, 2 for bf16).
  The logits and the cross-entropy's saved log-softmax add 2sbV fp32 elements on the last stage
  (split by tp). With activation checkpointing a block keeps only its input (sbh), plus one
  block's full activations while it is recomputed (the paper's ~2sbh per layer with its
  recompute buffer). Pipeline parallel is counted as GPipe, which holds every micro-batch of a
  step (1F1B holds fewer): the whole batch's activations of the stage's blocks.
  The estimate ignores allocator slack, temporaries (the fp32 upcast inside RoPE, softmax
  buffers) and communication buffers; the unit tests compare it with what autograd saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from meshrun.errors import ConfigError
from meshrun.models.llama import ModelArgs
from meshrun.parallel.dims import ParallelDims
from meshrun.plan.show import param_shapes, placements, stage_of_block

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
ADAM_STEP_BYTES = 4  # AdamW's per-tensor `step`, a float32 scalar tensor


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of one layout; `total` is their sum."""

    dims: ParallelDims
    params: int
    grads: int
    optim: int
    fsdp_buffers: int
    activations: int
    fits: bool | None = None
    """Whether `total` fits the device memory given to `candidates`; None when none was given."""

    @property
    def state(self) -> int:
        """params + grads + optim: what stays resident between steps."""
        return self.params + self.grads + self.optim

    @property
    def total(self) -> int:
        return self.state + self.fsdp_buffers + self.activations

    @property
    def layout(self) -> str:
        d = self.dims
        return f"dp_replicate={d.dp_replicate} dp_shard={d.dp_shard} tp={d.tp} pp={d.pp}"


def _check_dtype(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"train.dtype={dtype!r} is not known; use one of: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def state_bytes(args: ModelArgs, dims: ParallelDims,
                shapes: list[tuple[str, tuple[int, ...]]] | None = None) -> tuple[int, int, int, int]:
    """(params, grads, optim, fsdp_buffers) bytes on the most-loaded rank."""
    per_stage = [[0, 0] for _ in range(dims.pp)]  # [elements, tensors]
    block_full: dict[str, int] = {}  # block -> tp-local unsharded elements
    for p in placements(args, dims, shapes):
        local = p.max_local_numel(dims)
        for stage in p.stages:
            per_stage[stage][0] += local
            per_stage[stage][1] += 1
        if p.name.startswith("layers."):
            block = p.name.split(".")[1]
            full = list(p.shape)
            if p.tp_dim is not None:
                full[p.tp_dim] = -(-full[p.tp_dim] // dims.tp)
            block_full[block] = block_full.get(block, 0) + prod(full)
    numel, tensors = max(per_stage)
    buffers = 2 * 4 * max(block_full.values(), default=0) if dims.dp_shard > 1 else 0
    return 4 * numel, 4 * numel, 2 * 4 * numel + ADAM_STEP_BYTES * tensors, buffers


def activation_bytes(args: ModelArgs, dims: ParallelDims, *, batch_size: int, seq_len: int,
                     dtype: str = "fp32", activation_checkpointing: bool = False) -> int:
    """Saved-for-backward bytes on the fullest stage for one micro-batch (formula in the docstring)."""
    elem = _check_dtype(dtype)
    h, f, tp = args.dim, args.ffn_hidden, dims.tp
    h_kv = args.n_kv_heads * args.head_dim
    sb = batch_size * seq_len
    per_layer = sb * (7 * h + 3 * h_kv + 4 * f) // tp + 4 * sb * h
    stage_blocks = [0] * dims.pp
    for i in range(args.n_layers):
        stage_blocks[stage_of_block(i, args.n_layers, dims.pp)] += 1
    logits = 2 * sb * args.vocab_size * 4 // tp  # fp32 logits + log-softmax, last stage only
    totals = []
    for stage, blocks in enumerate(stage_blocks):
        if activation_checkpointing:
            acts = (blocks * sb * h + per_layer) * elem if blocks else 0
        else:
            acts = blocks * per_layer * elem
        totals.append(acts + (logits if stage == dims.pp - 1 else 0))
    return max(totals)


def estimate(args: ModelArgs, dims: ParallelDims, *, batch_size: int, seq_len: int,
             dtype: str = "fp32", activation_checkpointing: bool = False,
             shapes: list[tuple[str, tuple[int, ...]]] | None = None) -> MemoryEstimate:
    """The per-rank memory of training `args` under `dims` (see the module docstring)."""
    for key, value in (("train.batch_size", batch_size), ("data.seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    params, grads, optim, buffers = state_bytes(args, dims, shapes)
    acts = activation_bytes(args, dims, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
                            activation_checkpointing=activation_checkpointing)
    return MemoryEstimate(dims, params, grads, optim, buffers, acts)


def layouts(args: ModelArgs, world_size: int) -> list[ParallelDims]:
    """Every (dp_replicate, dp_shard, tp, pp) with product world_size, tp dividing n_heads and
    n_kv_heads, and pp <= n_layers."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be an integer >= 1, got {world_size!r}")
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    out = []
    for pp in divisors:
        if pp > args.n_layers:
            continue
        for tp in divisors:
            if (world_size // pp) % tp or args.n_heads % tp or args.n_kv_heads % tp:
                continue
            rest = world_size // (pp * tp)
            for dp_shard in (d for d in divisors if rest % d == 0):
                out.append(ParallelDims(rest // dp_shard, dp_shard, tp, pp, world_size=world_size))
    return out


@dataclass(frozen=True)
class Plan:
    """Ranked candidate layouts; `recommended` is the first."""

    ranked: list[MemoryEstimate]
    device_memory: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def recommended(self) -> MemoryEstimate:
        return self.ranked[0]


def rank_key(est: MemoryEstimate) -> tuple:
    """The ranking rule: layouts that fit first; then the least model parallelism (tp x pp, as
    TP puts collectives inside every block and PP adds a pipeline bubble, while FSDP's traffic
    overlaps with compute), PP after TP at equal products; then the least total memory per
    rank; then fewer replicas (more sharding) as the tie-break."""
    d = est.dims
    return (est.fits is False, d.tp * d.pp, d.pp, est.total, d.dp_replicate)


def candidates(args: ModelArgs, *, world_size: int, batch_size: int, seq_len: int,
               dtype: str = "fp32", activation_checkpointing: bool = False,
               device_memory: int | None = None) -> Plan:
    """Estimate every layout of `world_size` ranks and rank them with `rank_key`."""
    _check_dtype(dtype)
    found = layouts(args, world_size)
    if not found:  # only when no tp/pp fits the model, e.g. world 1 always has (1, 1, 1, 1)
        raise ConfigError(f"no layout of {world_size} ranks fits model heads/layers")
    shapes = param_shapes(args)
    ests = []
    for dims in found:
        est = estimate(args, dims, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
                       activation_checkpointing=activation_checkpointing, shapes=shapes)
        fits = None if device_memory is None else est.total <= device_memory
        ests.append(MemoryEstimate(est.dims, est.params, est.grads, est.optim,
                                   est.fsdp_buffers, est.activations, fits))
    return Plan(sorted(ests, key=rank_key), device_memory)
