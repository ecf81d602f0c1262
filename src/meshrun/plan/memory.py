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
- fsdp_buffers: with dp_shard > 1 (or cp > 1, sharded with it), the all-gathered (unsharded)
  parameters of two blocks, the one computing and the one prefetched (FSDP2's default of one
  block ahead).
- activations: the peak bytes autograd holds saved for backward on the fullest pipeline rank,
  for ``batch_size`` x ``seq_len`` per data-parallel rank (`meshrun.plan.activations`); a cp
  rank holds seq_len / cp of each sequence.
Checked against the measurement in one process (tests/unit/test_plan.py) and per rank for every
layout of tests/e2e/test_parallel_matrix.py (within 1%, zero bubble 11%).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod

from meshrun.errors import ConfigError
from meshrun.models.args import ModelArgs
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.rules import check_world_size, divisors, model_fits
from meshrun.plan.activations import activation_bytes, dtype_bytes
from meshrun.plan.ring import ring_bytes
from meshrun.plan.show import param_shapes, placements

GIB = 2**30
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
    ring: int = 0
    """Context parallel: bytes this rank receives in the ring per step (meshrun.plan.ring); not memory."""
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
        cp = f" cp={d.cp}" if d.cp > 1 else ""
        return f"dp_replicate={d.dp_replicate} dp_shard={d.dp_shard}{cp} tp={d.tp} pp={d.pp}"


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
    buffers = 2 * 4 * max(block_full.values(), default=0) if dims.fsdp_enabled else 0
    return 4 * numel, 4 * numel, 2 * 4 * numel + ADAM_STEP_BYTES * tensors, buffers


def estimate(args: ModelArgs, dims: ParallelDims, *, batch_size: int, seq_len: int,
             dtype: str = "fp32", activation_checkpointing: bool = False,
             shapes: list[tuple[str, tuple[int, ...]]] | None = None,
             **pipeline_and_tp: object) -> MemoryEstimate:
    """The per-rank memory of training `args` under `dims` (see the module docstring).

    `pipeline_and_tp`: `activation_bytes`'s sequence_parallel, loss_parallel, pp_schedule,
    pp_microbatches and pp_stages_per_rank (defaults: off, GPipe, one micro-batch per stage)."""
    for key, value in (("train.batch_size", batch_size), ("data.seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    params, grads, optim, buffers = state_bytes(args, dims, shapes)
    acts = activation_bytes(args, dims, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
                            activation_checkpointing=activation_checkpointing, **pipeline_and_tp)
    ring = ring_bytes(args, dims, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
                      activation_checkpointing=activation_checkpointing)
    return MemoryEstimate(dims, params, grads, optim, buffers, acts, ring)


def layouts(args: ModelArgs, world_size: int, seq_len: int = 0) -> list[ParallelDims]:
    """Every (dp_replicate, dp_shard, tp, pp) with product world_size that the layout rules accept
    for `args` (`rules.model_fits`: tp divides n_heads and n_kv_heads, pp <= n_layers, no pp with
    tied embeddings, ep dividing the experts). With a `seq_len`, also the context-parallel ones: cp > 1 dividing the
    ranks left, seq_len divisible by 2 x cp (`rules.check_context_parallel`)."""
    check_world_size(world_size)
    found = divisors(world_size)
    out = []
    for pp in found:
        for tp in found:
            if (world_size // pp) % tp or not model_fits(tp=tp, pp=pp, n_heads=args.n_heads,
                                                         n_kv_heads=args.n_kv_heads, n_layers=args.n_layers,
                                                         tie_embeddings=args.tie_embeddings,
                                                         experts=args.experts):
                continue
            rest = world_size // (pp * tp)
            for dp_shard in (d for d in found if rest % d == 0):
                out.append(ParallelDims(rest // dp_shard, dp_shard, tp, pp, world_size=world_size))
            if seq_len:
                for cp in (d for d in found if d > 1 and rest % d == 0 and seq_len % (2 * d) == 0):
                    for dp_shard in (d for d in found if rest // cp % d == 0):
                        out.append(ParallelDims(rest // cp // dp_shard, dp_shard, tp, pp, world_size=world_size, cp=cp))
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


# A model whose whole training state (fp32 weights, grads, AdamW's moments) is below this is
# replicated, not sharded, when replicas fit: sharding it saves little memory and adds collectives.
REPLICATE_BELOW = 2**30


def rank_key(est: MemoryEstimate) -> tuple:
    """The ranking rule: layouts that fit first; then the least model parallelism (tp x pp x cp, as
    TP puts collectives inside every block, PP adds a pipeline bubble and CP sends keys and values
    round a ring in every block, while FSDP's traffic overlaps with compute), PP after TP at equal
    products; then, for a model whose training state
    is under REPLICATE_BELOW, the least sharding (plain DDP); then the least total memory per
    rank; then fewer replicas (more sharding) as the tie-break."""
    d = est.dims
    state = (est.params + est.grads + est.optim) * d.dp_shard * d.cp * d.tp * d.pp  # unsharded, roughly
    small = state < REPLICATE_BELOW
    return (est.fits is False, d.tp * d.pp * d.cp, d.pp, d.dp_shard if small else 0, est.total, d.dp_replicate)


def candidates(args: ModelArgs, *, world_size: int, batch_size: int, seq_len: int,
               dtype: str = "fp32", activation_checkpointing: bool = False,
               device_memory: int | None = None, context_parallel: bool = False) -> Plan:
    """Estimate every layout of `world_size` ranks and rank them with `rank_key`;
    `context_parallel` adds the layouts that split the sequence."""
    dtype_bytes(dtype)
    found = layouts(args, world_size, seq_len if context_parallel else 0)
    if not found:  # only when no tp/pp fits the model, e.g. world 1 always has (1, 1, 1, 1)
        raise ConfigError(f"no layout of {world_size} ranks fits model heads/layers")
    shapes = param_shapes(args)
    ests = []
    for dims in found:
        est = estimate(args, dims, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
                       activation_checkpointing=activation_checkpointing, shapes=shapes)
        fits = None if device_memory is None else est.total <= device_memory
        ests.append(replace(est, fits=fits))
    return Plan(sorted(ests, key=rank_key), device_memory)
