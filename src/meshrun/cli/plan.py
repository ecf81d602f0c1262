"""`meshrun plan`: estimate per-rank memory of every parallel layout and recommend one.

    meshrun plan --model small --world 8 --device-memory 16 --batch-size 8 --seq-len 512
    meshrun plan examples/configs/tiny.toml --world 4        # model, batch, seq_len, dtype from it
    meshrun plan --show examples/configs/tiny.toml --world 4 --set parallel.tp=2 --set parallel.dp_shard=2

The estimate lives in `meshrun.plan.memory` (state, ranking) and `meshrun.plan.activations`, the
placement rules in `meshrun.plan.show`, the layout rules in `meshrun.parallel.resolve`; this
module parses arguments and formats.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from math import prod

from meshrun.argparser import Parser
from meshrun.cli.argtypes import positive_int
from meshrun.errors import ConfigError
from meshrun.plan.memory import GIB, MemoryEstimate, Plan, candidates

EPILOG = """\
ranking: layouts that fit --device-memory first; then the least model parallelism (tp x pp x cp;
TP before PP at equal products); then, for a model whose training state is under 1 GiB, plain
data parallel (no sharding); then the least total memory per rank. Sizes are per rank, in GiB,
or MiB when every layout needs under 1 GiB.
params are fp32 (meshrun keeps fp32 weights; bf16 is autocast), optim is AdamW's two moments.
ring/step (layouts with cp): what a cp rank receives per step in context parallel's ring, the
keys and values of the other cp ranks and their gradients (communication, not memory).

--simulate: the real build and one step per representative rank (each pipeline stage's first
rank and its rank with the last shard); bytes are the local shards', peak is the most tensor
bytes held in a step with the optimizer state there (torch's MemTracker), collectives are per
mesh dimension (count and this rank's input bytes per step; a pipeline's sends and receives
too, in a step after the first, which infers the stages' shapes; MoE: tokens routed evenly);
ckpt writes is its part of a checkpoint save (its
shards of the saved state, plus its share of the tensors other ranks hold too, which DCP writes
once among them). With --device: the projected step time, tokens/s
per GPU and MFU (meshrun.plan.project: compute at --compute-efficiency of the dense peak plus a
pipeline's bubble, data-parallel traffic overlapped, TP, context-parallel and pipeline traffic
added); a rank whose weights, gradients and optimizer state are over
the device's memory is refused, and one whose simulated peak is over it is warned about.

examples:
  meshrun plan --model 8b --world 64 --device-memory 80 --batch-size 1 --seq-len 8192
  meshrun plan examples/configs/gpu-8b.toml --simulate --nnodes 128 --nproc-per-node 8 --device h100
  meshrun plan examples/configs/gpu-8b.toml --simulate --compare --nnodes 4 --nproc-per-node 8 --device h100
  meshrun plan --model tiny --world 4 --activation-checkpointing
  meshrun plan --model 1b --world 8 --seq-len 32768 --context-parallel --device-memory 80
  meshrun plan --show my.toml --world 4 --set parallel.strategy=fsdp --set parallel.tp=2
"""


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 GiB, got {value:g}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="meshrun plan", epilog=EPILOG,
               description="Estimate per-rank training memory of every parallel "
                           "layout for a model and world size, and recommend one.",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="TOML config; omitted = the defaults")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--model", help="named size (tiny, tiny-moe, small, base, 1b, 8b, 70b); default: the config's model")
    p.add_argument("--world", type=int, default=None,
                   help="total ranks; default for --show: the product of the config's degrees")
    p.add_argument("--device-memory", type=_gib, default=None, metavar="GIB",
                   help="memory per device in GiB; layouts above it are marked and ranked last")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="samples per micro-batch per data-parallel rank; default: train.batch_size")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sample; default: data.seq_len")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="activation dtype (bf16, fp16 = autocast); default: train.dtype")
    p.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="recompute blocks in backward (default: train.activation_checkpointing)")
    p.add_argument("--context-parallel", action="store_true", default=None,
                   help="also rank layouts that split each sequence over cp ranks (default: when the "
                        "config's parallel.cp > 1)")
    p.add_argument("--top", type=positive_int, default=None,
                   help="rows of the table to print (default 12); with --compare, layouts to simulate (default 6)")
    p.add_argument("--simulate", action="store_true",
                   help="build the config's real layout at full world size and run one training step, "
                        "one representative rank at a time, under torch's fake process group and fake "
                        "tensors: each rank's real shard bytes and every collective of the step")
    p.add_argument("--nnodes", type=positive_int, default=None,
                   help="--simulate: nodes (world = nnodes x nproc-per-node; default 1)")
    p.add_argument("--nproc-per-node", type=positive_int, default=None,
                   help="--simulate: ranks per node (default: --world, or launch.nproc_per_node)")
    p.add_argument("--json", action="store_true", help="--simulate: print the result as JSON")
    p.add_argument("--compare", action="store_true",
                   help="--simulate: simulate the planner's best --top layouts (default 6) of the world instead of "
                        "the config's, and rank them: those whose state fits the device first, then by projected "
                        "tokens/s per GPU (with --device), else by peak memory")
    p.add_argument("--device", default=None, metavar="NAME",
                   help="--simulate: project step time, tokens/s and MFU on this device (a100, h100, h200, b200), "
                        "and refuse a rank whose weights, gradients and optimizer state are over its memory "
                        "(or --device-memory)")
    p.add_argument("--inter-node-gbps", type=float, default=400.0, metavar="GBITS",
                   help="--simulate --device: network bandwidth per GPU between nodes, Gb/s (default 400)")
    p.add_argument("--compute-efficiency", type=float, default=None, metavar="FRACTION",
                   help="--simulate --device: share of the dense peak the model's FLOPs run at (default: "
                        "the device's, from published eager training: h100 0.40, a100 0.60)")
    p.add_argument("--show", action="store_true",
                   help="print each parameter's placements and local shape per rank for the "
                        "config's [parallel] layout instead")
    return p


MIB = 2**20


def table_unit(plan: Plan) -> tuple[str, int]:
    """GiB when some layout needs 1 GiB or more per rank, else MiB, so that small models show differences."""
    return ("GiB", GIB) if max(e.total for e in plan.ranked) >= GIB else ("MiB", MIB)


def _fmt(n: int, unit: int = GIB) -> str:
    value = n / unit
    return f"{value:.1f}" if value >= 10 else f"{value:.3f}"


def format_table(plan: Plan, top: int) -> str:
    cp = any(e.dims.cp > 1 for e in plan.ranked)  # a cp column only when a layout splits the sequence
    cols = ("#", "dp_rep", "dp_shard", *(("cp",) if cp else ()), "tp", "pp", "params", "grads", "optim",
            "fsdp_buf", "activ", "total", "fits", *(("ring/step",) if cp else ()))
    rows = []
    _, unit = table_unit(plan)
    for i, e in enumerate(plan.ranked[:top], 1):
        d = e.dims
        fits = "-" if e.fits is None else "yes" if e.fits else "no"
        rows.append((str(i), str(d.dp_replicate), str(d.dp_shard), *((str(d.cp),) if cp else ()), str(d.tp),
                     str(d.pp), _fmt(e.params, unit), _fmt(e.grads, unit), _fmt(e.optim, unit),
                     _fmt(e.fsdp_buffers, unit), _fmt(e.activations, unit), _fmt(e.total, unit), fits,
                     *((_fmt(e.ring, unit) if e.ring else "-",) if cp else ())))
    widths = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [cols, *rows]]
    if len(plan.ranked) > top:
        lines.append(f"... {len(plan.ranked) - top} more layouts (--top N to see them)")
    return "\n".join(lines)


def strategy_of(d) -> str:
    """The parallel.strategy a layout of these degrees needs: plain DDP only without sharding or splits."""
    return "fsdp" if d.dp_shard > 1 or d.cp > 1 or d.tp > 1 or d.pp > 1 else "ddp"


def parallel_toml(e: MemoryEstimate) -> str:
    d = e.dims
    strategy = strategy_of(d)
    return "\n".join(["[parallel]", f'strategy = "{strategy}"', f"dp_replicate = {d.dp_replicate}",
                      f"dp_shard = {d.dp_shard}", *([f"cp = {d.cp}"] if d.cp > 1 else []), f"tp = {d.tp}",
                      f"pp = {d.pp}"])


def _world_for_show(cfg, world: int | None) -> int:
    """--world; else the [launch] world when it is fixed; else the product of the degrees."""
    from meshrun.launch.args import fixed_world_size
    from meshrun.parallel.resolve import ParallelOptions, stated_degrees

    if world is not None:
        return world
    fixed = fixed_world_size(cfg.launch.nproc_per_node, cfg.launch.nnodes)
    if fixed is not None:
        return fixed
    degrees = stated_degrees(ParallelOptions.from_config(cfg))
    if -1 in degrees.values():
        rest = next(name for name, value in degrees.items() if value == -1)
        raise ConfigError(f"--show needs --world N (or a number in launch.nproc_per_node): "
                          f"parallel.{rest} is -1, the ranks left")
    return prod(degrees.values())


def _config_line(cfg, plan: Plan, args, world: int, batch: int, seq: int, own_model: bool = True) -> str:
    """Where the config's own [parallel] layout, resolved for `world`, sits in the table."""
    from meshrun.errors import MeshrunError
    from meshrun.models.from_config import model_shape_from_config
    from meshrun.parallel.resolve import ParallelOptions, resolve_layout

    options = replace(ParallelOptions.from_config(cfg), batch_size=batch, seq_len=seq)
    try:
        layout = resolve_layout(options, world, model_shape_from_config(cfg.model if own_model else None, args))
    except MeshrunError as err:
        return f"config [parallel] on {world} ranks: refused ({err})"
    from meshrun.plan.experts import expert_plan

    degrees = layout.dims.degrees
    row = next((i for i, e in enumerate(plan.ranked, 1) if e.dims.degrees == degrees), None)
    line = f"config [parallel] on {world} ranks: {layout.describe()}" + (f" (row {row})" if row else "")
    experts = expert_plan(args, layout.dims, batch_size=batch, seq_len=seq, grad_accum=options.grad_accum,
                          dtype=options.dtype, param_dtype=layout.param_dtype)
    return line + (f"\n{experts.describe()}" if experts else "")


def main(argv: list[str]) -> int:
    from meshrun.config import load_config
    from meshrun.models.from_config import model_args_from_config, model_shape_from_config
    from meshrun.models.sizes import get_size
    from meshrun.parallel.resolve import ParallelOptions, resolve_layout
    from meshrun.plan.show import format_show

    a = build_parser().parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    if cfg.model.factory:
        raise ConfigError(f"model.factory={cfg.model.factory!r}: meshrun plan knows only the "
                          "built-in decoder's shapes; unset model.factory or use --model SIZE")
    args = get_size(a.model, key="--model") if a.model else model_args_from_config(cfg.model)
    if a.world is not None and a.world < 1:
        raise ConfigError(f"--world must be >= 1, got {a.world}")
    if a.simulate:
        return _simulate(cfg, a)
    if a.show:
        options = ParallelOptions.from_config(cfg)
        if a.batch_size:
            options = replace(options, batch_size=a.batch_size)
        layout = resolve_layout(options, _world_for_show(cfg, a.world),
                                model_shape_from_config(None if a.model else cfg.model, args))
        print(f"resolved: {layout.describe()}")
        print(format_show(args, layout.dims))
        return 0
    if a.world is None:
        raise ConfigError("--world N is required: the total number of ranks to plan for")
    batch = a.batch_size or cfg.train.batch_size
    seq = a.seq_len or cfg.data.seq_len
    dtype = a.dtype or cfg.train.dtype
    ac = cfg.train.activation_checkpointing if a.activation_checkpointing is None else True
    limit = None if a.device_memory is None else int(a.device_memory * GIB)
    cp = cfg.parallel.cp != 1 if a.context_parallel is None else True
    plan = candidates(args, world_size=a.world, batch_size=batch, seq_len=seq, dtype=dtype,
                      activation_checkpointing=ac, device_memory=limit, context_parallel=cp)
    print(f"model: {args.num_params() / 1e6:.2f}M params (dim {args.dim}, {args.n_layers} layers, "
          f"{args.n_heads} heads, {args.n_kv_heads} kv heads)   world: {a.world}   batch {batch} x "
          f"seq {seq} per data-parallel rank, {dtype}"
          + (", activation checkpointing" if ac else "")
          + (f"   device memory: {a.device_memory:g} GiB" if limit else ""))
    unit_name, unit = table_unit(plan)
    print(f"{unit_name} per rank, {len(plan.ranked)} layouts, best first:")
    print(format_table(plan, a.top or 12))
    print(_config_line(cfg, plan, args, a.world, batch, seq, own_model=not a.model))
    best = plan.recommended
    if best.fits is False:
        smallest = min(plan.ranked, key=lambda e: e.total)
        raise ConfigError(f"no layout of {a.world} ranks fits in {a.device_memory:g} GiB per device; "
                          f"the smallest needs {smallest.total / GIB:.2f} GiB ({smallest.layout}); "
                          "use more ranks, a smaller --batch-size/--seq-len, "
                          "--activation-checkpointing or --dtype bf16")
    why = ("; the model's training state is under 1 GiB, so replicas (DDP) beat sharding"
           if best.dims.dp_shard == best.dims.tp == best.dims.pp == 1 and best.dims.world_size > 1 else "")
    print(f"\nrecommended: {best.layout} ({_fmt(best.total, unit)} {unit_name} per rank{why}); "
          "paste into your config:\n")
    print(parallel_toml(best))
    return 0


def _simulate_world(cfg, a) -> tuple[int, int]:
    """(world, ranks per node): --nnodes x --nproc-per-node; else --world (one node); else the
    config's fixed launch world."""
    from meshrun.launch.args import fixed_world_size

    if a.nnodes is not None or a.nproc_per_node is not None:
        per_node = a.nproc_per_node or (fixed_world_size(cfg.launch.nproc_per_node, "1") or 1)
        return (a.nnodes or 1) * per_node, per_node
    if a.world is not None:
        return a.world, a.world
    fixed = fixed_world_size(cfg.launch.nproc_per_node, cfg.launch.nnodes)
    if fixed is None:
        raise ConfigError("--simulate needs the world: --nnodes N --nproc-per-node G (or --world N)")
    return fixed, fixed_world_size(cfg.launch.nproc_per_node, "1") or fixed


def _simulate(cfg, a) -> int:
    import json

    from meshrun.train.simulate import simulate

    if a.model:
        raise ConfigError("--model: --simulate builds the config's own model; set [model] in the config "
                          "(or --set model.name=SIZE)")
    from meshrun.plan.project import check_inputs
    from meshrun.plan.project import device as known_device

    if a.compute_efficiency is not None and not a.device:
        raise ConfigError("--compute-efficiency needs --device NAME: the device the projection is for")
    dev = known_device(a.device) if a.device else None  # bad projection inputs are refused before the simulation
    check_inputs(a.compute_efficiency, a.inter_node_gbps)
    world, per_node = _simulate_world(cfg, a)
    if a.compare:
        return _compare(cfg, a, world, per_node, dev)
    sim = simulate(cfg, world)
    projection = _project(cfg, a, sim, per_node) if dev else None
    limit = a.device_memory * GIB if a.device_memory else dev.memory_gib * GIB if dev else None
    if a.json:
        print(json.dumps({
            "world": world, "layout": sim.layout.describe(), "seconds": round(sim.seconds, 2), "note": sim.note,
            "ranks": [{"rank": r.rank, "coords": r.coords, "params": r.params, "grads": r.grads, "optim": r.optim,
                       "peak": r.peak, "checkpoint": r.checkpoint, "collectives": [vars(c) for c in r.collectives]}
                      for r in sim.ranks],
            "projection": None if projection is None else {
                "device": projection.device.name, "compute_efficiency": projection.efficiency,
                "inter_node_gbps": projection.inter_node_gbps, "compute_s": projection.compute_s,
                "comm_s": projection.comm_s, "exposed_s": projection.exposed_s, "step_s": projection.step_s,
                "pipeline_bubble": projection.bubble,
                "tokens_per_s_per_gpu": projection.tokens_per_s_per_gpu, "mfu": projection.mfu}}, indent=1))
        _check_memory(sim, limit)
        return 0
    unit_name, unit = ("GiB", GIB) if max(r.peak.get("total", r.state) for r in sim.ranks) >= GIB else ("MiB", MIB)
    print(f"simulated {world} ranks ({sim.layout.describe()}) in {sim.seconds:.1f} s: "
          f"{len(sim.ranks)} representative rank(s), one training step each")
    if sim.note:
        print(f"note: {sim.note}")
    cols = ("rank", "coords", "params", "grads", "optim", "state", "peak", "peak activ", "ckpt writes")
    rows = [(str(r.rank), " ".join(f"{k}={v}" for k, v in r.coords.items() if sim.layout.dims.degrees.get(k, 1) > 1)
             or "-", _fmt(r.params, unit), _fmt(r.grads, unit), _fmt(r.optim, unit), _fmt(r.state, unit),
             _fmt(r.peak["total"], unit) if r.peak else "-",
             _fmt(r.peak["act"] + r.peak["temp"], unit) if r.peak else "-",
             _fmt(r.checkpoint["expected"], unit) if r.checkpoint else "-")
            for r in sim.ranks]
    widths = [max(len(row[i]) for row in [cols, *rows]) for i in range(len(cols))]
    print(f"{unit_name} per rank:")
    for row in [cols, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    shared = [r for r in sim.ranks if r.checkpoint.get("replicated")]
    if shared:  # what "ckpt writes" shares out
        r = max(shared, key=lambda r: r.checkpoint["replicated"])
        print(f"ckpt writes: its own shards, plus its share of the tensors other ranks hold too, which a "
              f"checkpoint writes once among them (rank {r.rank}: {_fmt(r.checkpoint['own'], unit)} own, "
              f"{_fmt(r.checkpoint['replicated'], unit)} held by others too)")
    print("\ncollectives per step (count, MiB of this rank's inputs):")
    for r in sim.ranks:
        uses = ", ".join(f"{c.kind} over {c.dim}: {c.count} x, {c.bytes / MIB:.1f}" for c in r.collectives)
        print(f"  rank {r.rank}: {uses or 'none'}")
    if projection is not None:
        print("\n" + projection.describe())
    _check_memory(sim, limit)
    return 0


def _compare(cfg, a, world: int, per_node: int, dev) -> int:
    """--simulate --compare: the planner's best layouts of `world` (meshrun.plan.memory.candidates),
    each simulated as the config with that [parallel] layout, then ranked."""
    from dataclasses import replace as with_fields

    from meshrun.errors import MeshrunError
    from meshrun.models.from_config import model_args_from_config
    from meshrun.plan.project import seconds_text
    from meshrun.train.simulate import simulate

    if a.json:
        raise ConfigError("--compare prints a table; --json is for one layout (drop --compare)")
    limit = a.device_memory * GIB if a.device_memory else dev.memory_gib * GIB if dev else None
    args = model_args_from_config(cfg.model)
    plan = candidates(args, world_size=world, batch_size=cfg.train.batch_size, seq_len=cfg.data.seq_len,
                      dtype=cfg.train.dtype, activation_checkpointing=cfg.train.activation_checkpointing,
                      context_parallel=cfg.parallel.cp != 1)
    rows, skipped = [], []
    for est in plan.ranked[:a.top or 6]:
        d = est.dims
        parallel = with_fields(cfg.parallel, strategy=strategy_of(d), dp_replicate=d.dp_replicate, dp_shard=d.dp_shard,
                               cp=d.cp, tp=d.tp, pp=d.pp)
        candidate = with_fields(cfg, parallel=parallel)
        try:
            sim = simulate(candidate, world)
        except MeshrunError as exc:
            skipped.append(f"{est.layout}: {' '.join(str(exc).split())}")
            continue
        state = max(r.state for r in sim.ranks)
        peak = max((r.peak["total"] for r in sim.ranks if r.peak), default=None)
        projection = _project(candidate, a, sim, per_node) if dev else None
        fits = None if limit is None else state <= limit
        rows.append((est, sim, state, peak, projection, fits))
    if not rows:
        raise ConfigError(f"--compare: none of the {len(skipped)} best layouts could be simulated: {skipped[0]}")
    # fits first; then the most tokens per second per GPU (a layout with less data parallelism has a
    # smaller global batch, so its shorter step is not faster training); else the least peak memory
    rows.sort(key=lambda r: (r[5] is False, -r[4].tokens_per_s_per_gpu if r[4] else 0.0, r[3] or r[2]))
    unit_name, unit = ("GiB", GIB) if max(r[3] or r[2] for r in rows) >= GIB else ("MiB", MIB)
    print(f"compared {len(rows)} layouts of {world} ranks, each simulated (one training step per representative "
          f"rank); {unit_name} per rank, best first:")
    cols = ("#", "layout", "state", "peak", *(("step", "tokens/s/GPU", "MFU") if dev else ()), "fits")
    table = []
    for i, (est, _, state, peak, projection, fits) in enumerate(rows, 1):
        fit = "-" if fits is None else "yes" if fits else "no"
        projected = (seconds_text(projection.step_s), f"{projection.tokens_per_s_per_gpu:,.0f}",
                     f"{projection.mfu:.1%}") if projection else ()
        table.append((str(i), est.layout, _fmt(state, unit), "-" if peak is None else _fmt(peak, unit), *projected, fit))
    widths = [max(len(row[i]) for row in [cols, *table]) for i in range(len(cols))]
    for row in [cols, *table]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    for line in skipped:
        print(f"not simulated: {line}")
    print("\nbest: paste into your config:\n")
    print(parallel_toml(rows[0][0]))
    return 0


def _project(cfg, a, sim, per_node: int):
    """The projection of `sim` on --device (meshrun.plan.project), or None with a note for a model
    whose FLOPs per token meshrun does not know (an HF model)."""
    from meshrun.models.args import flops_per_token
    from meshrun.models.from_config import model_args_from_config
    from meshrun.plan.project import project

    if cfg.model.hf:
        print("note: no projection for model.hf (FLOPs per token are known for the built-in decoder only)")
        return None
    args = model_args_from_config(cfg.model)
    return project(sim, flops_per_token=flops_per_token(args, cfg.data.seq_len), seq_len=cfg.data.seq_len,
                   nproc_per_node=per_node, device_name=a.device, inter_node_gbps=a.inter_node_gbps,
                   efficiency=a.compute_efficiency, dtype=cfg.train.dtype,
                   activation_checkpointing=bool(cfg.train.activation_checkpointing))


def _check_memory(sim, limit: float | None) -> None:
    """Refuse, as the launch would run out of memory, a rank whose weights, gradients and optimizer
    state (exact: the real local shards) are over the device's memory; warn when its simulated peak
    is. The peak warns and does not refuse: it is measured by torch's tracker above the runtime,
    without the allocator's fragmentation and caching, which a device adds."""
    if limit is None:
        return

    def size(n: float) -> str:
        return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"

    worst = max(sim.ranks, key=lambda r: r.state)
    if worst.state > limit:
        raise ConfigError(
            f"rank {worst.rank} of {sim.layout.describe()} holds {size(worst.state)} of weights, gradients and "
            f"optimizer state ({size(worst.params)} + {size(worst.grads)} + {size(worst.optim)}) before any "
            f"activation, more than the device's {size(limit)}; shard more ([parallel] dp_shard, tp or pp) or use "
            "more ranks")
    peak = max(sim.ranks, key=lambda r: r.peak.get("total", 0))
    if peak.peak.get("total", 0) > limit:
        print(f"warning: rank {peak.rank}'s simulated peak, {size(peak.peak['total'])}, is over the device's "
              f"{size(limit)}", file=sys.stderr)
