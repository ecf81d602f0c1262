"""Every parallel layout rule and its one-line message; `meshrun.parallel.resolve` composes them.

Pure Python, no torch: config validation, `meshrun plan`, pre-flight and the build all call these
before any process group exists. Each rule raises one `ConfigError` that names the keys, their
values and a fix. No other module in src/ raises a layout message of its own (checked by
tests/unit/test_parallel_resolve.py), so a new parallelism adds its rules here, once. In order:
single keys, degrees vs world size, TP features, the model's shape, the pipeline plan (its
schedules, and the papers they come from, are `meshrun.parallel.pipeline`'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd, prod
from typing import Any

from meshrun.errors import ConfigError

STRATEGIES = ("ddp", "fsdp")
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp")
DTYPE_NAMES = ("fp32", "bf16")  # `meshrun.parallel.resolve.torch_dtype` maps them to torch
MODEL_KEYS = ("n_heads", "n_kv_heads", "n_layers", "tie_embeddings")  # what the rules read of a model

# meshrun name -> (torch class name for get_schedule_class, several stages per rank).
# Left out, measured on torch 2.13 / gloo: ZBVZeroBubble trains right without data parallel but
# its `eval()` fails ("can't steal_bwd_input"), and DualPipeV needs overlapped F/B callbacks.
SCHEDULES: dict[str, tuple[str, bool]] = {
    "gpipe": ("GPipe", False),
    "1f1b": ("1F1B", False),
    "interleaved_1f1b": ("Interleaved1F1B", True),
    "looped_bfs": ("LoopedBFS", True),
    "interleaved_zero_bubble": ("InterleavedZeroBubble", True),
}
# Zero bubble splits each backward into input and weight gradients; with fully_shard data
# parallel the losses drift from one process (3.8629 vs 3.8645 at step 2 here), so it is
# refused with dp > 1.
ZERO_BUBBLE = ("interleaved_zero_bubble",)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]  # small n: world sizes and batch sizes


def _listing(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def _show(value: Any) -> str:  # as a TOML file or `--set` spells it
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def require(key: str, ok: bool, expected: str, value: Any) -> None:
    """Raise `KEY must be EXPECTED, got VALUE` unless ok (the config sections' own wording)."""
    if not ok:
        raise ConfigError(f"{key} must be {expected}, got {_show(value)}")


def check_choice(key: str, value: Any, choices) -> None:
    require(key, value in tuple(choices), "one of " + ", ".join(map(repr, choices)), value)


def check_count(key: str, value: Any, low: int, note: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    require(key, ok, f">= {low}{note}", value)


def check_degree(name: str, value: Any) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or value == -1)
    require(f"parallel.{name}", ok, "an integer >= 1 or -1 (the ranks left)", value)


def check_world_size(world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be an integer >= 1, got {world_size!r}")


def check_rest(degrees: dict[str, int]) -> str | None:
    """The one degree that is -1 (the ranks left), or None; two or more is an error."""
    rest = [name for name in DEGREES if degrees[name] == -1]
    if len(rest) > 1:
        raise ConfigError(f"only one of parallel.{', parallel.'.join(DEGREES)} may be -1, "
                          f"got -1 for {', '.join(rest)}; set all but one of them")
    return rest[0] if rest else None


def check_strategy(strategy: str, degrees: dict[str, int]) -> None:
    """`ddp` only replicates (whole model, or its pipeline stages): no sharding, no TP."""
    if strategy == "ddp":
        for name in ("dp_shard", "tp"):
            require(f"parallel.{name}", degrees[name] == 1,
                    "1 with parallel.strategy = 'ddp' (it only replicates)", degrees[name])


def strategy_degrees(strategy: str, degrees: dict[str, int]) -> dict[str, int]:
    """The degrees a strategy means. With `fsdp` and both data-parallel degrees at their defaults
    (dp_replicate=-1, dp_shard=1, plain replication), the ranks left go to dp_shard instead:
    asking for FSDP should shard, not silently replicate."""
    out = dict(degrees)
    if strategy == "fsdp" and (out["dp_replicate"], out["dp_shard"]) == (-1, 1):
        out["dp_replicate"], out["dp_shard"] = 1, -1
    return out


def resolve_degrees(degrees: dict[str, int], world_size: int, *, strategy: str = "fsdp") -> dict[str, int]:
    """Check the four degrees against `world_size` and infer the one left at -1; the fixes a
    message proposes are ones `strategy` allows."""
    check_world_size(world_size)
    for name in DEGREES:
        check_degree(name, degrees[name])
    out = dict(degrees)
    rest = check_rest(out)
    if rest is not None:
        others = prod(out[n] for n in DEGREES if n != rest)
        if world_size % others:
            fixed = " x ".join(f"parallel.{n}={out[n]}" for n in DEGREES if n != rest and out[n] > 1)
            raise ConfigError(
                f"parallel.{rest}=-1 takes the ranks left, but {fixed or '1'} = {others} does not "
                f"divide the world size {world_size}; use degrees whose product divides it "
                f"(divisors: {_listing(divisors(world_size))})")
        out[rest] = world_size // others
    product = prod(out[n] for n in DEGREES)
    if product != world_size:
        text = " x ".join(f"parallel.{n}={out[n]}" for n in DEGREES)
        free = [n for n in DEGREES if strategy != "ddp" or n not in ("dp_shard", "tp")]
        fits = [f"parallel.{n}={world_size // others}" for n in free
                if world_size % (others := prod(out[m] for m in DEGREES if m != n)) == 0]
        hint = f"e.g. {' or '.join(fits)}, " if fits else ""
        raise ConfigError(f"{text} = {product} does not equal the world size {world_size}; "
                          f"{hint}or set one degree to -1 to take the ranks left")
    return out


def check_tp_features(tp: int, pp: int, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Sequence and loss parallel split over the tp ranks, and make a stage's output a DTensor,
    which the pipeline's point-to-point sends do not carry. A degree of -1 is not known yet."""
    on = [key for key, on in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)) if on]
    if not on:
        return
    keys = " and ".join(f"parallel.{key}=true" for key in on)
    one = len(on) == 1
    if tp == 1:
        raise ConfigError(f"{keys} {'splits' if one else 'split'} over tensor-parallel ranks, but "
                          "parallel.tp=1; set parallel.tp > 1 (with parallel.strategy = 'fsdp') or "
                          f"turn {'it' if one else 'them'} off")
    if pp > 1:
        raise ConfigError(f"{keys} {'does' if one else 'do'} not compose with parallel.pp={pp} (pipeline "
                          f"stages send plain tensors); turn {'it' if one else 'them'} off or set parallel.pp=1")


def model_shape_of(args: Any) -> dict[str, Any]:
    """n_heads, n_kv_heads (n_heads when unset), n_layers, tie_embeddings of an args object;
    None for what it does not say (a user model)."""
    n_heads, n_kv_heads, n_layers, tied = (getattr(args, key, None) for key in MODEL_KEYS)
    return dict(n_heads=n_heads, n_kv_heads=n_kv_heads or n_heads, n_layers=n_layers, tie_embeddings=tied)


def check_stages(pp: int, n_layers: int | None, world_size: int, stages_per_rank: int = 1) -> None:
    """Every pipeline stage needs at least one block."""
    num_stages = pp * stages_per_rank
    if n_layers is None or num_stages <= n_layers:
        return
    single = stages_per_rank == 1
    what = "" if single else f" x {stages_per_rank} stages per rank = {num_stages} stages"
    fix = (f"valid: {_listing([d for d in divisors(world_size) if d <= n_layers])}" if single
           else f"use at most {n_layers} stages")
    raise ConfigError(f"parallel.pp={pp}{what} exceeds model.n_layers={n_layers} (a stage needs at "
                      f"least one block); {fix}")


def check_tied_pipeline(tie_embeddings: bool | None) -> None:
    """Pipeline stages cannot share the embedding matrix with the output layer."""
    if tie_embeddings:
        raise ConfigError("pipeline parallel with model.tie_embeddings=true would split the shared "
                          "matrix between the first and last stage; set model.tie_embeddings=false")


def _heads_problem(tp: int, world_size: int, n_heads: int | None, n_kv_heads: int | None) -> str | None:
    """Colwise TP gives each rank whole heads: tp must divide the query and key/value heads."""
    if tp <= 1:
        return None
    for key, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if heads is not None and heads % tp:
            common = gcd(n_heads or heads, n_kv_heads or heads)
            valid = [d for d in divisors(common) if world_size % d == 0]
            return f"parallel.tp={tp} does not divide model.{key}={heads}; valid: {_listing(valid)}"
    return None


def check_model_shape(*, tp: int, pp: int, world_size: int, n_heads: int | None = None,
                      n_kv_heads: int | None = None, n_layers: int | None = None,
                      tie_embeddings: bool | None = None) -> None:
    """tp divides the heads, pp stages have a block each, no tied embeddings under pp; None skips."""
    problem = _heads_problem(tp, world_size, n_heads, n_kv_heads)
    if problem:
        raise ConfigError(problem)
    check_stages(pp, n_layers, world_size)
    if pp > 1:
        check_tied_pipeline(tie_embeddings)


def model_fits(*, tp: int, pp: int, n_heads: int, n_kv_heads: int, n_layers: int,
               tie_embeddings: bool = False) -> bool:
    """`check_model_shape` as a test (`meshrun plan` lists the layouts that pass)."""
    return (_heads_problem(tp, tp, n_heads, n_kv_heads) is None and pp <= n_layers
            and not (pp > 1 and tie_embeddings))



@dataclass(frozen=True)
class PipelinePlan:
    """What a pipeline layout is, resolved and checked before any process group exists."""

    schedule: str
    num_stages: int
    stages_per_rank: int
    microbatches: int
    layers: list[list[str]]
    """Block names (keys of model.layers) per stage, in stage order; [] when planned without
    the model's depth (checks only: resolve again with the model to build)."""

    def stage_ids(self, pp_rank: int, pp: int) -> list[int]:
        """The stages this pipeline rank holds, in the order the schedule wants them."""
        return [pp_rank + k * pp for k in range(self.stages_per_rank)]


def default_stages_per_rank(schedule: str, requested: int = 0) -> int:
    """The stages each pipeline rank holds: `requested`, or for 0: 1 for single-stage schedules,
    2 for the interleaved ones."""
    check_choice("parallel.pp_schedule", schedule, SCHEDULES)
    return requested or (2 if SCHEDULES[schedule][1] else 1)


def plan_pipeline(*, pp: int, schedule: str, stages_per_rank: int, split_points: str,
                  n_layers: int | None, batch_size: int, microbatches: int, dp_size: int = 1,
                  world_size: int | None = None) -> PipelinePlan:
    """Resolve and check a pipeline layout; every problem is one ConfigError naming the key.

    stages_per_rank 0 = 1 for single-stage schedules, 2 for the others. split_points '' =
    balanced (later stages take the remainder), else the first block of each stage after the
    first, e.g. '1' or 'layers.1' for pp=2. microbatches 0 = one per stage. n_layers None =
    the depth is not known (a user model): the split is left empty.
    """
    per_rank = default_stages_per_rank(schedule, stages_per_rank)
    multi = SCHEDULES[schedule][1]
    if schedule in ZERO_BUBBLE and dp_size > 1:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} does not train correctly with data "
                          f"parallel ({dp_size} dp ranks) on torch 2.13; use 'interleaved_1f1b', "
                          "or give the ranks to parallel.pp / parallel.tp")
    if multi and per_rank < 2:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} interleaves several stages per rank, "
                          f"but parallel.pp_stages_per_rank={per_rank}; set it to 2 or more "
                          "(or 0 for 2), or use 'gpipe' / '1f1b'")
    if not multi and per_rank != 1:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} runs one stage per rank, but "
                          f"parallel.pp_stages_per_rank={per_rank}; use 1 (or 0), or an interleaved "
                          "schedule such as 'interleaved_1f1b'")
    num_stages = pp * per_rank
    check_stages(pp, n_layers, world_size or pp, per_rank)
    layers = split_layers(n_layers, num_stages, split_points) if n_layers is not None else []
    n_micro = microbatches or num_stages
    if batch_size % n_micro:
        raise ConfigError(f"parallel.pp_microbatches={n_micro} does not divide train.batch_size="
                          f"{batch_size}; valid: {_listing(divisors(batch_size))}")
    if schedule == "1f1b" and n_micro < num_stages:
        raise ConfigError(f"parallel.pp_schedule='1f1b' needs parallel.pp_microbatches >= the "
                          f"{num_stages} stages, got {n_micro}")
    rounds = max(1, n_micro // pp)  # torch's interleaved schedules run rounds of pp micro-batches
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and n_micro % rounds:
        raise ConfigError(f"parallel.pp_microbatches={n_micro} must be a multiple of parallel.pp={pp} "
                          f"(or at most {pp}) for {schedule!r}")
    return PipelinePlan(schedule, num_stages, per_rank, n_micro, layers)


def split_layers(n_layers: int, num_stages: int, split_points: str = "") -> list[list[str]]:
    """Block names per stage: balanced, or cut before each block index in `split_points`."""
    if not split_points.strip():
        # Stage s takes blocks [s*n/S, (s+1)*n/S): later stages get the remainder, the rule
        # `meshrun plan` counts memory with (meshrun.plan.show.stage_of_block).
        cuts = [s * n_layers // num_stages for s in range(1, num_stages)]
    else:
        cuts = []
        for item in split_points.split(","):
            text = item.strip().removeprefix("layers.")
            if not text.isdigit():
                raise ConfigError(f"parallel.pp_split_points={split_points!r}: {item.strip()!r} is not a "
                                  "block index; write e.g. '2' or 'layers.2,layers.5'")
            cuts.append(int(text))
        if len(cuts) != num_stages - 1:
            raise ConfigError(f"parallel.pp_split_points={split_points!r} gives {len(cuts) + 1} stages, "
                              f"but the layout has {num_stages}; list {num_stages - 1} block indices")
        if cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] >= n_layers:
            raise ConfigError(f"parallel.pp_split_points={split_points!r} must be increasing block "
                              f"indices in 1..{n_layers - 1}, so every stage keeps a block")
    bounds = [0, *cuts, n_layers]
    return [[str(i) for i in range(bounds[s], bounds[s + 1])] for s in range(num_stages)]


def check_compile(compile_on: bool, tp: int, sequence_parallel: bool) -> None:
    """torch 2.13: a compiled TP block fed plain tensors loses the DTensor gradient in backward."""
    require("train.compile", not (compile_on and tp > 1 and not sequence_parallel), "false with parallel.tp > 1 unless parallel.sequence_parallel=true", compile_on)
