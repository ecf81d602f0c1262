"""The one layout resolver: typed `ParallelOptions` + world size -> a checked `ResolvedLayout`.

    from meshrun.parallel.resolve import ParallelOptions, ModelShape, resolve_layout
    layout = resolve_layout(ParallelOptions(strategy="fsdp", tp=2), world_size=4,
                            model=ModelShape(n_heads=4, n_kv_heads=2, n_layers=4))
    layout.dims.dp_shard, layout.pipeline, layout.param_dtype, layout.describe()
    layout = resolve_layout(ParallelOptions.from_config(cfg), world_size)   # from a JobConfig

Config validation (`check_options`, no world size needed), `meshrun config show`, `meshrun
plan`, the pre-flight of `meshrun train` and the build all go through here, so every consumer
accepts and refuses the same layouts with the same one-line `ConfigError`. The rules and their
messages live in `meshrun.parallel.rules`; this module composes them. No torch at import: a bad
layout is refused before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from meshrun.parallel import rules, rules_pp
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.rules import DEGREES, DTYPE_NAMES, STRATEGIES
from meshrun.parallel.rules_pp import SCHEDULES, ResolvedPipeline

if TYPE_CHECKING:  # no meshrun.config import, not even here: config imports this module
    import torch

__all__ = [
    "DTYPE_NAMES", "SCHEDULES", "STRATEGIES", "ResolvedLayout", "ModelShape", "ParallelOptions",
    "ResolvedPipeline", "check_options", "resolve_layout", "stated_degrees", "torch_dtype",
]

TRAIN_KEYS = ("batch_size", "grad_accum", "dtype", "activation_checkpointing")
"""The `[train]` keys a layout depends on; every other option is a `[parallel]` key but DATA_KEYS."""
DATA_KEYS = ("seq_len", "packing")
"""The `[data]` keys a layout depends on (context parallel splits the sequence, which packing's mask cannot follow)."""


def torch_dtype(name: str) -> torch.dtype:
    """'fp32' -> torch.float32, 'bf16' -> torch.bfloat16, 'fp16' -> torch.float16 (the one table)."""
    import torch

    rules.check_choice("dtype", name, DTYPE_NAMES)
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass(frozen=True)
class ParallelOptions:
    """Every `[parallel]` key plus the `[train]` keys a layout depends on (TRAIN_KEYS).

    Defaults are the config's (each key's doc: `meshrun config show`), so tests and benchmarks
    write `ParallelOptions(strategy="fsdp", tp=2)`. Nothing is checked at construction:
    `check_options` / `resolve_layout` do that, naming the config key.
    """

    strategy: str = "ddp"
    dp_replicate: int = -1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "gpipe"
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 0
    pp_split_points: str = ""
    sequence_parallel: bool = False
    loss_parallel: bool = False
    fsdp_reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    param_dtype: str = "auto"
    reduce_dtype: str = "fp32"
    batch_size: int = 16
    grad_accum: int = 1
    dtype: str = "fp32"
    activation_checkpointing: bool = False
    seq_len: int = 0
    """data.seq_len; 0 = not known (its rules are skipped)."""
    packing: bool = False
    """data.packing."""

    @classmethod
    def from_sections(cls, parallel: Any, train: Any = None, data: Any = None) -> ParallelOptions:
        """From a `[parallel]` section (and a `[train]` and `[data]` one; None = train's defaults,
        the sequence length unknown)."""
        values = {f.name: getattr(parallel, f.name) for f in fields(cls)
                  if f.name not in TRAIN_KEYS + DATA_KEYS}
        if train is not None:
            values.update({name: getattr(train, name) for name in TRAIN_KEYS})
        if data is not None:
            values.update({name: getattr(data, name) for name in DATA_KEYS})
        return cls(**values)

    @classmethod
    def from_config(cls, cfg: Any) -> ParallelOptions:
        """From a `meshrun.config.JobConfig`: its `[parallel]`, `[train]` and `[data]` sections."""
        return cls.from_sections(cfg.parallel, cfg.train, cfg.data)

    @property
    def degrees(self) -> dict[str, int]:
        """The five degrees as written (-1 = the ranks left, before the strategy's default)."""
        return {name: getattr(self, name) for name in DEGREES}


@dataclass(frozen=True)
class ModelShape:
    """What the layout rules read from a model; None skips that check (a user model that does
    not say)."""

    n_heads: int | None = None
    n_kv_heads: int | None = None
    n_layers: int | None = None
    tie_embeddings: bool | None = None
    experts: int | None = None

    @classmethod
    def from_args(cls, args: Any) -> ModelShape:
        """From the built-in `ModelArgs` or any object with those attributes (n_kv_heads unset =
        n_heads)."""
        return cls(**rules.model_shape_of(args))

    @classmethod
    def from_model(cls, model: Any) -> ModelShape:
        """From a module: its `args` if it has them, else the depth of `model.layers` alone; a
        model.hf adapter's `routed_experts` (its args, the built-in shape, have none)."""
        inner = getattr(model, "module", model)  # DDP's wrapper
        args = getattr(inner, "args", None)
        if args is not None:
            shape = cls.from_args(args)
            routed = getattr(inner, "routed_experts", None)
            return replace(shape, experts=routed) if routed else shape
        layers = getattr(inner, "layers", None)
        return cls(n_layers=len(layers) if layers is not None else None)


@dataclass(frozen=True)
class ResolvedLayout:
    """A checked layout for `world_size` ranks: what the build applies and what plans print."""

    options: ParallelOptions
    world_size: int
    dims: ParallelDims
    """Degrees with -1 inferred and the strategy's default applied."""
    use_mesh: bool
    """False only for plain DDP (strategy 'ddp', pp 1): no DeviceMesh, one process group."""
    pipeline: ResolvedPipeline | None
    """The checked pipeline plan when pp > 1, else None."""
    param_dtype: str
    """FSDP compute dtype of parameters ('fp32' / 'bf16'), 'auto' resolved to train.dtype."""
    reduce_dtype: str

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: the data loader's num_replicas."""
        return self.dims.dp_size

    def describe(self) -> str:
        """One line, e.g. 'fsdp: dp_shard 2 x tp 2 (world 4); params bf16, reduce fp32'."""
        o = self.options
        parts = [f"{o.strategy}: {self.dims.describe()}"]
        if self.pipeline is not None:
            p = self.pipeline
            parts.append(f"pipeline {p.schedule}, {p.num_stages} stages ({p.stages_per_rank} per rank), "
                         f"{p.microbatches} micro-batches")
        if self.use_mesh:
            parts.append(f"params {self.param_dtype}, reduce {self.reduce_dtype}")
        flags = [name.replace("_", " ") for name in ("sequence_parallel", "loss_parallel",
                                                     "activation_checkpointing") if getattr(o, name)]
        return "; ".join(parts + flags)


def stated_degrees(options: ParallelOptions) -> dict[str, int]:
    """The degrees `options` mean before a world size is known: checked, the strategy's default
    applied (fsdp shards the ranks left), -1 still "the ranks left"."""
    check_options(options)
    return rules.strategy_degrees(options.strategy, options.degrees)


def check_options(options: ParallelOptions) -> None:
    """Every rule that needs no world size: choices, ranges, and the keys that go together.

    Config validation calls this (`ParallelSection.validate`); `resolve_layout` calls it first.
    """
    o = options
    rules.check_choice("parallel.strategy", o.strategy, STRATEGIES)
    for name in DEGREES:
        rules.check_degree(name, getattr(o, name))
    rules.check_rest(o.degrees)
    rules.check_strategy(o.strategy, o.degrees)
    rules.check_choice("parallel.pp_schedule", o.pp_schedule, SCHEDULES)
    rules.check_count("parallel.pp_microbatches", o.pp_microbatches, 0, " (0 = one per stage)")
    rules.check_count("parallel.pp_stages_per_rank", o.pp_stages_per_rank, 0, " (0 = as the schedule needs)")
    rules.require("parallel.pp_split_points", isinstance(o.pp_split_points, str),
                  "a string such as '' or '1,3'", o.pp_split_points)
    rules.check_choice("parallel.param_dtype", o.param_dtype, ("auto", *DTYPE_NAMES))
    rules.check_choice("parallel.reduce_dtype", o.reduce_dtype, DTYPE_NAMES)
    rules.check_count("train.batch_size", o.batch_size, 1)
    rules.check_count("train.grad_accum", o.grad_accum, 1)
    rules.check_choice("train.dtype", o.dtype, DTYPE_NAMES)
    rules.check_tp_features(o.tp, o.pp, o.sequence_parallel, o.loss_parallel)
    rules.check_precision(o.dtype, o.pp, o.param_dtype)
    stated = rules.strategy_degrees(o.strategy, o.degrees)
    rules.check_context_parallel(stated["cp"], seq_len=o.seq_len)
    rules.check_expert_parallel(o.ep, dp_shard=stated["dp_shard"], cp=stated["cp"], strategy=o.strategy)
    rules.check_packing(o.packing, cp=stated["cp"])


def resolve_layout(options: ParallelOptions, world_size: int, model: ModelShape | None = None) -> ResolvedLayout:
    """The layout `options` give on `world_size` ranks, or one ConfigError naming the keys and
    the fix. `model` adds the shape rules (heads vs tp, blocks vs stages, tied embeddings) and
    the pipeline's block split; without it those are left to a later call with the model."""
    degrees = rules.resolve_degrees(stated_degrees(options), world_size, strategy=options.strategy)
    dims = ParallelDims(**degrees, world_size=world_size, ep=options.ep)
    rules.check_tp_features(dims.tp, dims.pp, options.sequence_parallel, options.loss_parallel)
    rules.check_precision(options.dtype, dims.pp, options.param_dtype)
    rules.check_context_parallel(dims.cp, seq_len=options.seq_len)
    rules.check_packing(options.packing, cp=dims.cp)
    shape = model or ModelShape()
    rules.check_model_shape(tp=dims.tp, pp=dims.pp, world_size=world_size, n_heads=shape.n_heads,
                            n_kv_heads=shape.n_kv_heads or shape.n_heads, n_layers=shape.n_layers,
                            tie_embeddings=shape.tie_embeddings, experts=shape.experts, ep=dims.ep)
    pipeline = None
    if dims.pp > 1:
        pipeline = rules_pp.resolve_pipeline(
            pp=dims.pp, schedule=options.pp_schedule, stages_per_rank=options.pp_stages_per_rank,
            split_points=options.pp_split_points, n_layers=shape.n_layers,
            batch_size=options.batch_size, microbatches=options.pp_microbatches,
            dp_size=dims.dp_size, world_size=world_size)
    param = options.dtype if options.param_dtype == "auto" else options.param_dtype
    return ResolvedLayout(options, world_size, dims, use_mesh=not (options.strategy == "ddp" and dims.pp == 1),
                  pipeline=pipeline, param_dtype=param, reduce_dtype=options.reduce_dtype)
