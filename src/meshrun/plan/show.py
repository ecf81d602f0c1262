"""Where each parameter lives under a layout: placements per mesh axis and local shape per rank.

    meshrun plan --show examples/configs/tiny.toml --world 4 --set parallel.tp=2

Computed without launching processes: the global shapes come from the model built on the
``meta`` device, and the placements from the rules meshrun applies (they mirror the code, so a
change there must be made here too):

- tp (`meshrun.parallel.tp`, Megatron-LM arXiv:1909.08053): ColwiseParallel on wq/wk/wv, w1/w3
  and the output layer shards the weight's dim 0 (output features); RowwiseParallel on wo/w2
  shards dim 1 (input features); the embedding, rowwise, shards dim 0 (vocabulary rows). Norms
  stay replicated. A tied embedding/output matrix stays replicated.
- dp_shard (`meshrun.parallel.fsdp`, FSDP2 ``fully_shard``): every parameter's dim 0 is sharded
  over dp_shard (Shard(0)), after TP: a tp-sharded dim 0 is split again (torch calls this
  _StridedShard). Uneven dims follow ``torch.chunk``: the last ranks may hold fewer rows.
- cp (`meshrun.parallel.context`): FSDP shards over dp_shard x cp together (the flattened
  "dp_shard_cp" axis, dp_shard major), so both axes show Shard(0).
- dp_replicate: Replicate (DDP, or HSDP's replica axis).
- pp: a balanced split by blocks (stage k holds blocks [k*L//pp, (k+1)*L//pp)); the embedding
  sits on the first stage, the final norm and output on the last. Ranks of other stages hold
  nothing of that parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from meshrun.models.args import ModelArgs
from meshrun.parallel.dims import MESH_AXES, ParallelDims

COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")


@dataclass(frozen=True)
class ParamPlacement:
    """One parameter under a layout."""

    name: str
    """Its name in ``model.named_parameters()``."""
    shape: tuple[int, ...]
    """Global (unsharded) shape."""
    stages: tuple[int, ...]
    """Pipeline stages that hold it (all of them when pp is 1)."""
    placements: dict[str, str]
    """Mesh axis -> 'Shard(d)' or 'Replicate()', for the axes that hold a copy of it."""
    tp_dim: int | None
    """Tensor dim split over tp, or None."""
    fsdp: bool
    """Whether dim 0 is split over dp_shard (x cp)."""

    def local_shape(self, tp_index: int, dp_shard_index: int, dims: ParallelDims) -> tuple[int, ...]:
        """The shape rank (tp_index, dp_shard_index) holds: tp split first, then FSDP's dim 0;
        with cp > 1, dp_shard_index is the rank's index on dp_shard x cp (dp_shard major)."""
        shape = list(self.shape)
        if self.tp_dim is not None and dims.tp > 1:
            shape[self.tp_dim] = chunk_len(shape[self.tp_dim], dims.tp, tp_index)
        if self.fsdp and shape:
            shape[0] = chunk_len(shape[0], dims.dp_shard * dims.cp, dp_shard_index)
        return tuple(shape)

    def max_local_numel(self, dims: ParallelDims) -> int:
        """Elements on the most-loaded rank that holds it (FSDP2 pads every shard to this size)."""
        return prod(self.local_shape(0, 0, dims))


def chunk_len(n: int, parts: int, index: int) -> int:
    """Length of piece `index` of ``torch.chunk(range(n), parts)`` (0 past the end)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def param_shapes(args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each parameter of the built-in decoder, from a model on the meta device."""
    from meshrun.models.llama import Transformer
    from meshrun.models.meta import on_meta

    with on_meta():
        model = Transformer(args)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def stage_block_ranges(n_layers: int, pp: int) -> list[tuple[int, int]]:
    """Each pipeline stage's blocks under the balanced split, as (start, stop): no loop over the
    blocks, which a sized config may count in billions."""
    return [(stage * n_layers // pp, (stage + 1) * n_layers // pp) for stage in range(pp)]


def stage_of_block(index: int, n_layers: int, pp: int) -> int:
    """The pipeline stage of block `index` under the balanced split."""
    for stage in range(pp):
        if index < (stage + 1) * n_layers // pp:
            return stage
    return pp - 1


def place(name: str, shape: tuple[int, ...], args: ModelArgs, dims: ParallelDims) -> ParamPlacement:
    """The placement of one parameter under `dims` (rules in the module docstring)."""
    tied = args.tie_embeddings
    tp_dim: int | None = None
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        stages: tuple[int, ...] = (stage_of_block(int(index), args.n_layers, dims.pp),)
        module = rest.rsplit(".", 1)[0]
        tp_dim = 0 if module in COLWISE else 1 if module in ROWWISE else None
    elif name.startswith("tok_embeddings."):
        stages = (0, dims.pp - 1) if tied else (0,)
        tp_dim = None if tied else 0
    elif name.startswith("output."):
        stages = (dims.pp - 1,)
        tp_dim = None if tied else 0
    else:  # the final norm
        stages = (dims.pp - 1,)
    stages = tuple(sorted(set(stages)))
    fsdp = dims.fsdp_enabled
    placements = {
        "dp_replicate": "Replicate()",
        "dp_shard": "Shard(0)" if fsdp else "Replicate()",
        **({"cp": "Shard(0)"} if dims.cp_enabled else {}),
        "tp": f"Shard({tp_dim})" if tp_dim is not None and dims.tp > 1 else "Replicate()",
    }
    return ParamPlacement(name, shape, stages, placements, tp_dim if dims.tp > 1 else None, fsdp)


def placements(args: ModelArgs, dims: ParallelDims,
               shapes: list[tuple[str, tuple[int, ...]]] | None = None) -> list[ParamPlacement]:
    """Every parameter's placement under `dims`; pass `shapes` to reuse a `param_shapes` result."""
    dims.check_model_args(args)
    return [place(name, shape, args, dims) for name, shape in (shapes or param_shapes(args))]


def rank_coords(rank: int, dims: ParallelDims) -> dict[str, int]:
    """A rank's index on each mesh axis (MESH_AXES order, tp innermost, as `build_mesh` lays them)."""
    coords = {}
    for axis in reversed(MESH_AXES):
        size = getattr(dims, axis)
        coords[axis] = rank % size
        rank //= size
    return {axis: coords[axis] for axis in MESH_AXES}


def local_shapes(p: ParamPlacement, dims: ParallelDims) -> list[tuple[int, ...] | None]:
    """The local shape on each rank 0..world-1; None where the rank's stage does not hold it."""
    out: list[tuple[int, ...] | None] = []
    for rank in range(dims.world_size):
        c = rank_coords(rank, dims)
        shard = c["dp_shard"] * dims.cp + c["cp"]
        out.append(p.local_shape(c["tp"], shard, dims) if c["pp"] in p.stages else None)
    return out


def _ranks_text(ranks: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def format_show(args: ModelArgs, dims: ParallelDims) -> str:
    """The `meshrun plan --show` report: one line per parameter."""
    axes = [a for a in ("dp_replicate", "dp_shard", "cp", "tp") if getattr(dims, a) > 1] or ["dp_replicate"]
    lines = [f"layout: {dims.describe()}   mesh axes (outer -> inner): "
             + ", ".join(f"{a}={getattr(dims, a)}" for a in MESH_AXES),
             "placements on " + ", ".join(axes) + "; local shape -> ranks that hold it"]
    rows = []
    for p in placements(args, dims):
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, shape in enumerate(local_shapes(p, dims)):
            if shape is not None:
                groups.setdefault(shape, []).append(rank)
        place_text = ", ".join(p.placements[a] for a in axes)
        if dims.pp > 1:
            place_text += f"  stage {','.join(str(s) for s in p.stages)}"
        local = "; ".join(f"{_shape_text(s)} on ranks {_ranks_text(r)}" for s, r in groups.items())
        rows.append((p.name, _shape_text(p.shape), place_text, local))
    widths = [max(len(r[i]) for r in rows + [("parameter", "global shape", "placements", "")])
              for i in range(3)]
    header = ("parameter", "global shape", "placements", "local shape per rank")
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(widths[i]) if i < 3 else cell for i, cell in enumerate(row)))
    return "\n".join(lines)
