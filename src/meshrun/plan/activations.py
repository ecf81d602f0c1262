"""Peak activation memory of a training step per rank: what autograd holds saved for backward.

    from meshrun.plan.activations import activation_bytes
    activation_bytes(get_size("small"), ParallelDims(1, 2, 2, 1, world_size=4), batch_size=8, seq_len=256)

The peak bytes autograd holds saved for backward during a training step (what
`meshrun.plan.measure.SavedActivations` measures), on the fullest pipeline rank, for
``batch_size`` x ``seq_len`` per data-parallel rank. Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models" (arXiv:2205.05198), count
sbh(34 + 5as/h) bytes per GPT layer (16-bit, dropout, 4h GELU MLP). For this decoder (no
dropout, SwiGLU of width f, RMSNorm, CPU/flash SDPA that keeps no s x s matrix) a layer saves
sb(4h + a + 4f)/tp (q, k, v as SDPA sees them, its output, its logsumexp, the four f-wide
SwiGLU tensors) plus sb(6h + 2) for the two norms (input, 1/rms, normalised input before and
after the weight), which TP leaves whole; sequence parallel splits the norms' first three
and saves the all-gathered linear inputs whole: sb(2(2h + 1)/tp + 2h). Times the element
size (4 fp32, 2 bf16). The last stage adds the final norm and the cross entropy's fp32
log-softmax (sbV, split by tp only with loss parallel); both ends add the int64 ids. A
mixture-of-experts block adds its routing's copies and indices (`_moe_extra_bytes`).
Context parallel divides the tokens by cp: a rank saves q, k, v, the output and the logsumexp
of its own tokens only (the ring's keys and values from other ranks are not kept).
Pipeline parallel counts the micro-batches a rank holds at once under its schedule (GPipe
and looped BFS: all; 1F1B: pp - rank; interleaved 1F1B: torch's warm-up + 1; interleaved
zero bubble: torch's own action order, where W frees only what weight gradients read).
With activation checkpointing a block keeps only its input (sbh), plus one block's
activations while it is recomputed (the paper's ~2sbh per layer with its recompute buffer).
Not counted: allocator slack, temporaries (the fp32 upcast inside RoPE, softmax buffers),
communication buffers, and the one metadata forward torch's pipeline runs on its first step
and after each eval.
Checked against the measurement in one process (tests/unit/test_plan.py) and per rank for every
layout of tests/e2e/test_parallel_matrix.py.
"""

from __future__ import annotations

from meshrun.models.args import ModelArgs
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.rules import DTYPE_NAMES, check_choice
from meshrun.parallel.rules_pp import default_stages_per_rank
from meshrun.plan.show import stage_block_ranges

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
assert tuple(DTYPE_BYTES) == DTYPE_NAMES, "one element size per dtype name"


def dtype_bytes(dtype: str) -> int:
    """The element size of a `train.dtype` name."""
    check_choice("train.dtype", dtype, DTYPE_NAMES)
    return DTYPE_BYTES[dtype]


def _moe_extra_bytes(args: ModelArgs, tokens: int, elem: int, tp: int = 1) -> int:
    """What a mixture-of-experts block (meshrun.models.moe) saves beyond a dense one: its SwiGLU
    tensors at the active width (top-k + shared) x moe_hidden, whole on every tp rank (tp splits
    only its attention), instead of the dense block's ffn_hidden split by tp; each token's k
    gathered inputs, expert outputs and weighted outputs (3kh); the fp32 router scores, chosen
    weights, their sum and weight column (E + 2k + 1); and three int64 index vectors of k per
    token (the choice, the sort by expert, the token of each slot)."""
    k = args.experts_per_token
    active = (k + args.shared_experts) * args.moe_hidden
    return tokens * ((4 * active - 4 * (args.ffn_hidden // tp) + 3 * k * args.dim) * elem
                     + 4 * (args.experts + 2 * k + 1) + 8 * 3 * k)


def _stage_bytes(args: ModelArgs, tp: int, tokens: int, elem: int, *, blocks: int, first: bool, last: bool,
                 sequence_parallel: bool, loss_parallel: bool,
                 activation_checkpointing: bool, moe_blocks: int = 0) -> tuple[int, int]:
    """Saved-for-backward bytes of one pipeline stage (or the whole model) for `tokens` tokens;
    and the part of them that outlives the weight-gradient pass of a zero-bubble schedule."""
    h, f = args.dim, args.ffn_hidden
    # Per token and block: q, k and v as SDPA sees them (k/v repeated to n_heads, so 3h), its
    # output (which wo reads in place), its logsumexp (n_heads), the four f-wide SwiGLU
    # tensors; all split by TP. The two RMSNorms save their input, 1/rms and the normalised
    # input before and after the weight (3h + 1 each). Under sequence parallel the first three
    # are split (2h + 1) and the output is saved only as the all-gathered (whole) input of
    # wq/wk/wv and w1/w3 (h).
    sp = sequence_parallel and tp > 1
    split = 4 * h + args.n_heads + 4 * f
    norms = 2 * (-(-(2 * h + 1) // tp) + h) if sp else 2 * (3 * h + 1)
    per_layer = tokens * (-(-split // tp) + norms)
    # What only the weight gradients read (the norms' two h-wide outputs, w2's input), freed by
    # a zero-bubble W; the rest stays until its graph goes at the end of the step.
    weight_only = tokens * ((-(-(2 * h) // tp) + 2 * h if sp else 4 * h) + -(-f // tp))
    moe = _moe_extra_bytes(args, tokens, elem, tp) if moe_blocks else 0
    if activation_checkpointing:  # block inputs, plus one block's activations while recomputed
        acts = (blocks * tokens * h + per_layer) * elem + moe if blocks else 0
        kept = acts
    else:
        acts = blocks * per_layer * elem + moe_blocks * moe
        kept = blocks * (per_layer - weight_only) * elem + moe_blocks * moe
    if first:
        acts += 8 * tokens  # the int64 token ids the embedding saves
        kept += 8 * tokens
    if last:  # final norm, the fp32 log-softmax the cross entropy saves, the int64 targets
        final = (-(-(2 * h + 1) // tp) + h) if sp else 3 * h + 1
        vocab = -(-args.vocab_size // tp) if loss_parallel else args.vocab_size
        acts += tokens * (final * elem + 4 * vocab + 8)
        kept += tokens * ((h + 1) * elem + 4 * vocab + 8)
    return acts, kept


def _zero_bubble_peak(pp_rank: int, pp: int, per_rank: int, microbatches: int,
                      stage_bytes: dict[int, tuple[int, int]]) -> int:
    """Peak of torch's interleaved zero-bubble (ZB1P, arXiv:2401.10241) on `pp_rank`, replaying
    the action order torch computes for it: F saves a micro-batch's activations; I (input
    gradients, graph retained) frees nothing; W (weight gradients) frees what only it reads,
    and the rest stays until the step ends."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    rounds = max(1, microbatches // pp)
    spec = SimpleNamespace(n_local_stages=per_rank, pp_group_size=pp, _n_microbatches=microbatches,
                           number_of_rounds=rounds, microbatches_per_round=microbatches // rounds,
                           rank=pp_rank)
    current = peak = 0
    for action in ScheduleInterleavedZeroBubble._calculate_single_rank_operations(spec, pp_rank):
        if action is None:
            continue
        full, kept = stage_bytes[action.stage_index]
        kind = action.computation_type.value
        if kind == "F":
            current += full
        elif kind == "W":
            current -= full - kept
        peak = max(peak, current)
    return peak


def _in_flight(schedule: str, pp_rank: int, pp: int, per_rank: int, microbatches: int) -> list[int]:
    """Micro-batches alive (forward done, backward not) at the peak, per local stage of `pp_rank`.

    GPipe and looped BFS run every forward before any backward. 1F1B (PipeDream-Flush) lets
    rank r run pp - r forwards before its first backward. torch's interleaved schedules warm
    up with (stages_per_rank - 1) x pp + 2 (pp - 1 - r) forwards, pp micro-batches per local
    stage in turn, then alternate, so one more is alive at the peak
    (torch/distributed/pipelining/schedules.py, Interleaved1F1B)."""
    if schedule in ("gpipe", "looped_bfs") or (per_rank == 1 and schedule != "1f1b"):
        return [microbatches] * per_rank
    if schedule == "1f1b":
        return [min(microbatches, pp - pp_rank)]
    per_round = min(microbatches, pp)
    alive = min(microbatches * per_rank, (per_rank - 1) * per_round + 2 * (pp - 1 - pp_rank) + 1)
    counts = [0] * per_rank
    done = 0
    while done < alive:
        for local in range(per_rank):
            take = min(per_round, alive - done, microbatches - counts[local])
            counts[local] += take
            done += take
    return counts


def activation_bytes(args: ModelArgs, dims: ParallelDims, *, batch_size: int, seq_len: int,
                     dtype: str = "fp32", activation_checkpointing: bool = False,
                     sequence_parallel: bool = False, loss_parallel: bool = False,
                     pp_schedule: str = "gpipe", pp_microbatches: int = 0,
                     pp_stages_per_rank: int = 0) -> int:
    """Peak saved-for-backward bytes on the fullest pipeline rank (formula in the docstring)."""
    elem = dtype_bytes(dtype)
    per_rank = default_stages_per_rank(pp_schedule, pp_stages_per_rank)
    num_stages = dims.pp * per_rank
    micro = pp_microbatches or (num_stages if dims.pp > 1 else 1)
    if batch_size % micro:  # the run itself refuses this (resolve_pipeline); count the whole batch
        micro = 1
    tokens = batch_size // micro * seq_len // dims.cp  # a cp rank holds seq_len / cp of each sequence
    ranges = stage_block_ranges(args.n_layers, num_stages)
    blocks = [stop - start for start, stop in ranges]
    moe_blocks = [args.moe_layers_between(start, stop) for start, stop in ranges]
    stage_bytes = {s: _stage_bytes(args, dims.tp, tokens, elem, blocks=blocks[s], first=s == 0,
                                   last=s == num_stages - 1, sequence_parallel=sequence_parallel,
                                   loss_parallel=loss_parallel,
                                   activation_checkpointing=activation_checkpointing, moe_blocks=moe_blocks[s])
                   for s in range(num_stages)}
    totals = []
    for pp_rank in range(dims.pp):
        if dims.pp > 1 and pp_schedule == "interleaved_zero_bubble":
            try:
                totals.append(_zero_bubble_peak(pp_rank, dims.pp, per_rank, micro, stage_bytes))
                continue
            except (AttributeError, TypeError, ValueError):  # torch's private order moved: count as 1F1B
                pass
        stages = [pp_rank + k * dims.pp for k in range(per_rank)]
        schedule = "interleaved_1f1b" if pp_schedule == "interleaved_zero_bubble" else pp_schedule
        alive = _in_flight(schedule, pp_rank, dims.pp, per_rank, micro) if dims.pp > 1 else [1]
        totals.append(sum(n * stage_bytes[s][0] for s, n in zip(stages, alive, strict=True)))
    return max(totals)
