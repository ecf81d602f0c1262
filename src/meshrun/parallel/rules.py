"""The parallel layout rules and their one-line messages; `meshrun.parallel.resolve` composes them.

Pure Python, no torch: config validation, `meshrun plan`, pre-flight and the build all call these
before any process group exists. Each rule raises one `ConfigError` that names the keys, their
values and a fix. No module but these raises a layout message of its own (checked by
tests/unit/test_parallel_resolve.py), so a new parallelism adds its rules here, once. In order:
single keys, degrees vs world size, TP features, the model's shape. The pipeline plan's rules
(schedules, micro-batches, split points) are in `meshrun.parallel.rules_pp`: every layout rule
lives in a `rules*.py` module of this package.
"""

from __future__ import annotations

from math import gcd, prod
from typing import Any

from meshrun.errors import ConfigError

STRATEGIES = ("ddp", "fsdp")
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
DTYPE_NAMES = ("fp32", "bf16", "fp16")  # `meshrun.parallel.resolve.torch_dtype` maps them to torch
MODEL_KEYS = ("n_heads", "n_kv_heads", "n_layers", "tie_embeddings", "experts")  # what the rules read of a model


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
    """`ddp` only replicates (whole model, or its pipeline stages): no sharding, no TP, no CP."""
    if strategy == "ddp":
        for name in ("dp_shard", "tp"):
            require(f"parallel.{name}", degrees[name] == 1,
                    "1 with parallel.strategy = 'ddp' (it only replicates)", degrees[name])
        if degrees.get("cp", 1) != 1:
            raise ConfigError(f"parallel.cp={degrees['cp']} shards the parameters over the data and context "
                              "ranks together (FSDP over dp_shard x cp), which parallel.strategy = 'ddp' does "
                              "not do; set parallel.strategy = 'fsdp'")


def strategy_degrees(strategy: str, degrees: dict[str, int]) -> dict[str, int]:
    """The degrees a strategy means. With `fsdp` and both data-parallel degrees at their defaults
    (dp_replicate=-1, dp_shard=1, plain replication), the ranks left go to dp_shard instead:
    asking for FSDP should shard, not silently replicate."""
    out = dict(degrees)
    if strategy == "fsdp" and (out["dp_replicate"], out["dp_shard"]) == (-1, 1):
        out["dp_replicate"], out["dp_shard"] = 1, -1
    return out


def resolve_degrees(degrees: dict[str, int], world_size: int, *, strategy: str = "fsdp") -> dict[str, int]:
    """Check the degrees against `world_size` and infer the one left at -1; the fixes a
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
        free = [n for n in DEGREES if strategy != "ddp" or n not in ("dp_shard", "cp", "tp")]
        fits = [f"parallel.{n}={world_size // others}" for n in free
                if world_size % (others := prod(out[m] for m in DEGREES if m != n)) == 0]
        hint = f"e.g. {' or '.join(fits)}, " if fits else ""
        raise ConfigError(f"{text} = {product} does not equal the world size {world_size}; "
                          f"{hint}or set one degree to -1 to take the ranks left")
    return out


def check_expert_parallel(ep: int, *, dp_shard: int, cp: int = 1, strategy: str = "fsdp") -> None:
    """Expert parallel borrows its ranks from the data-parallel shards, as torchtitan's does: the
    dense weights stay sharded over all dp_shard ranks, the experts over dp_shard / ep of them.
    A dp_shard of -1 is not known yet."""
    require("parallel.ep", isinstance(ep, int) and not isinstance(ep, bool) and ep >= 1,
            "an integer >= 1 (1 = off)", ep)
    if ep == 1:
        return
    if strategy == "ddp":
        raise ConfigError(f"parallel.ep={ep} splits the experts over data-parallel shard ranks (FSDP), which "
                          "parallel.strategy = 'ddp' does not have; set parallel.strategy = 'fsdp'")
    if cp != 1:
        raise ConfigError(f"parallel.ep={ep} with parallel.cp={cp}: expert parallel over context-parallel "
                          "ranks is not supported yet; set parallel.cp=1 or parallel.ep=1")
    if dp_shard != -1 and dp_shard % ep:
        raise ConfigError(f"parallel.ep={ep} must divide parallel.dp_shard={dp_shard} (expert parallel borrows "
                          f"data-parallel shard ranks); valid: {_listing(divisors(dp_shard))}")


def check_ep_model(ep: int, *, hf: str = "", factory: str = "") -> None:
    """Expert parallel dispatches the tokens of the built-in model's grouped experts and of
    transformers' experts (model.hf: an MoE without them is refused at build, as a dense model
    is); a model.factory model's experts compute their own way."""
    if ep <= 1 or not factory:
        return
    raise ConfigError(f"parallel.ep={ep} splits the routed experts of the built-in model and of model.hf; "
                      f"model.factory={factory!r} is not split (its experts route their own tokens); "
                      "set parallel.ep=1 and shard with parallel.dp_shard")


def _no_experts(ep: int) -> str:
    return (f"parallel.ep={ep} splits routed experts, but the model has none (the built-in model with "
            "model.experts > 0 and a model.hf mixture of experts have them); set parallel.ep=1")


def check_experts_found(ep: int, found: int) -> None:
    """Under expert parallel the model must have routed experts to split (a dense built-in model,
    model.hf or a user factory has none meshrun can find): checked before launch for the built-in
    model (model.experts = 0), at build for the others."""
    if ep > 1 and not found:
        raise ConfigError(_no_experts(ep))


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


def check_context_parallel(cp: int, *, seq_len: int = 0) -> None:
    """Context parallel splits each sequence over the cp ranks, two chunks each (head-tail load
    balancing: chunk r and chunk 2*cp-1-r of 2*cp, so every rank holds as much of the causal mask).
    A degree of -1 is not known yet; seq_len 0 = not known here."""
    if cp <= 1:
        return
    if seq_len and seq_len % (2 * cp):
        step = 2 * cp
        near = sorted({max(step, seq_len - seq_len % step), seq_len - seq_len % step + step})
        raise ConfigError(f"data.seq_len={seq_len} must divide into 2 x parallel.cp = {step} equal chunks "
                          f"(head-tail load balancing gives each cp rank two); e.g. data.seq_len="
                          f"{' or '.join(map(str, near))}")


def check_packing(packing: bool, *, cp: int, factory: str = "") -> None:
    """data.packing keeps attention inside each example with a mask built from the positions of a
    whole row; context parallel's ring attention sees a share of the row and takes no mask, and a
    user factory's model is not known to take one (meshrun.data.packing)."""
    if packing and cp > 1:
        raise ConfigError(f"data.packing=true masks attention at example boundaries, which the ring attention of "
                          f"parallel.cp={cp} cannot; set parallel.cp=1 or data.packing=false")
    if packing and factory:
        raise ConfigError(f"data.packing=true needs a model that keeps attention inside each example (the built-in "
                          f"model or model.hf); model.factory={factory!r} is not known to; set data.packing=false")


def check_cp_model(cp: int, *, factory: str = "") -> None:
    """Context parallel gives the model the positions of this rank's tokens and runs its attention
    as a ring: the built-in model and model.hf (its attention through transformers' attention
    interface) take both; a user factory's model is its own, so it is not split."""
    if cp <= 1 or not factory:
        return
    raise ConfigError(f"parallel.cp={cp} splits the sequence of the built-in model and model.hf models (their "
                      f"attention runs as a ring, their positions follow each rank's tokens); model.factory="
                      f"{factory!r} is not split; set parallel.cp=1")


def check_cp_attention(cp: int, hf: str, reason: str) -> None:
    """parallel.cp > 1 with a model.hf whose config.json asks for an attention the ring does not
    compute (`reason`, from models.hf_config.context_parallel_refusal; "" when it can)."""
    if cp > 1 and reason:
        raise ConfigError(f"parallel.cp={cp} cannot split the attention of model.hf={hf!r}: config.json "
                          f"{reason}; set parallel.cp=1")


def check_hf_tp(hf: str, sequence_parallel: bool, styles: dict[str, str], supported: tuple[str, ...],
                tp: int = 2, model_type: str = "") -> None:
    """A `model.hf` model under TP: its config's base_model_tp_plan gives the block plan, in
    styles meshrun maps; its decoder layers take keyword inputs, which sequence parallel cannot shard."""
    where = f"model.hf={hf!r}" + (f" (model_type {model_type!r})" if model_type else "")
    if sequence_parallel:
        raise ConfigError(f"parallel.sequence_parallel=true is not offered for {where} (HF decoder layers "
                          "take their inputs as keywords); turn it off")
    fix = "set parallel.tp=1 and shard with parallel.dp_shard (FSDP) instead"
    if not styles:
        raise ConfigError(f"parallel.tp={tp}: {where} declares no base_model_tp_plan in transformers, so there "
                          f"is no known way to split its layers; {fix}")
    bad = {pattern: style for pattern, style in styles.items() if style not in supported}
    if bad:
        raise ConfigError(f"parallel.tp={tp}: {where}: tensor-parallel styles {bad} are not supported "
                          f"(supported: {', '.join(supported)}); {fix}")


def check_hf_pp_order(hf: str, pp: int, unordered: tuple[str, ...]) -> None:
    """A `model.hf` model under PP: the modules with parameters registered before its decoder layers
    must be known to run before them (the first stage owns them), or the split would guess."""
    if unordered:
        raise ConfigError(f"parallel.pp={pp}: model.hf={hf!r} registers {', '.join(unordered)} before its decoder "
                          "layers, and its forward does not run on the meta device to show whether they run before "
                          "them; set parallel.pp=1 and shard with parallel.dp_shard (FSDP) instead")


def check_precision(dtype: str, pp: int, param_dtype: str = "auto") -> None:
    """fp16 needs its gradient scaler: the pipeline schedule computes (and backpropagates) the
    loss itself, where no scaler multiplies it; and fp16 FSDP parameters need train.dtype fp16."""
    if dtype == "fp16" and pp > 1:
        raise ConfigError(f"train.dtype='fp16' needs a loss scale, which the pipeline schedule of "
                          f"parallel.pp={pp} does not apply; use train.dtype='bf16' or parallel.pp=1")
    if param_dtype == "fp16" and dtype != "fp16":
        raise ConfigError(f"parallel.param_dtype='fp16' computes in fp16 without a gradient scaler under "
                          f"train.dtype={dtype!r}; set train.dtype='fp16' (it scales) or param_dtype 'auto'")


# What torch 2.13's optimizers cannot do on DTensor parameters (FSDP, TP), measured here:
# Adafactor's row/column norms need in-place placement changes (both kernels), and fused SGD
# has no sharding rule (fused Adam/AdamW have one; `optim.implementation = "auto"` avoids it).
NO_DTENSOR = {("adafactor", "fused"), ("adafactor", "foreach"), ("adafactor", "for-loop"),
              ("adafactor", "auto"), ("sgd", "fused")}


def updates_shards(name: str, implementation: str) -> bool:
    """Whether optimizer `name` with this kernel can update DTensor parameters."""
    return (name, implementation) not in NO_DTENSOR


def check_optimizer_shards(name: str, implementation: str) -> None:
    """An optimizer (and kernel) that must update DTensor shards (FSDP, TP) can do so."""
    if not updates_shards(name, implementation):
        what = f"optim.name={name!r}" + (f" with optim.implementation={implementation!r}" if name == "sgd" else "")
        fix = "use optim.implementation='foreach'" if name == "sgd" else "use another optim.name"
        raise ConfigError(f"{what} cannot update FSDP/TP parameter shards (DTensors) on torch 2.13; {fix}, "
                          "or parallel.strategy='ddp' without sharding")


def shards_parameters(strategy: str, degrees: dict[str, int]) -> bool:
    """Whether a layout makes parameters DTensors: FSDP sharding, CP (sharded with it) or TP (-1
    counts as more than 1)."""
    out = strategy_degrees(strategy, degrees)
    return strategy == "fsdp" and (out["dp_shard"] != 1 or out.get("cp", 1) != 1 or out["tp"] != 1)


def model_shape_of(args: Any) -> dict[str, Any]:
    """n_heads, n_kv_heads (n_heads when unset), n_layers, tie_embeddings, experts of an args
    object; None for what it does not say (a user model)."""
    n_heads, n_kv_heads, n_layers, tied, experts = (getattr(args, key, None) for key in MODEL_KEYS)
    return dict(n_heads=n_heads, n_kv_heads=n_kv_heads or n_heads, n_layers=n_layers, tie_embeddings=tied,
                experts=experts)


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


def check_tied_pipeline(tie_embeddings: bool | None, pp: int = 2) -> None:
    """Pipeline stages cannot share the embedding matrix with the output layer."""
    if tie_embeddings:
        raise ConfigError(f"parallel.pp={pp} with a tied embedding and head (model.tie_embeddings=true, or a "
                          "model.hf config's tie_word_embeddings) would split the shared matrix between the "
                          "first and last stage; set model.tie_embeddings=false (the head then starts as a "
                          "copy of the embedding) or parallel.pp=1")


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


def _experts_problem(experts: int | None, ep: int = 1) -> str | None:
    """Expert parallel needs experts, a whole number of them on each ep rank. (Tensor parallel
    splits a mixture-of-experts model's attention and dense blocks: meshrun.parallel.tp.)"""
    if ep > 1 and experts == 0:
        return _no_experts(ep)
    if ep > 1 and experts is not None and experts % ep:
        return (f"model.experts={experts} is not divisible by parallel.ep={ep} (each ep rank holds "
                f"experts / ep of them); valid parallel.ep: {_listing(divisors(experts))}")
    return None


def check_model_shape(*, tp: int, pp: int, world_size: int, n_heads: int | None = None,
                      n_kv_heads: int | None = None, n_layers: int | None = None,
                      tie_embeddings: bool | None = None, experts: int | None = None, ep: int = 1) -> None:
    """tp divides the heads, pp stages have a block each, no tied embeddings under pp, ep divides
    the experts; None skips."""
    problem = _heads_problem(tp, world_size, n_heads, n_kv_heads) or _experts_problem(experts, ep)
    if problem:
        raise ConfigError(problem)
    check_stages(pp, n_layers, world_size)
    if pp > 1:
        check_tied_pipeline(tie_embeddings, pp)


def model_fits(*, tp: int, pp: int, n_heads: int, n_kv_heads: int, n_layers: int,
               tie_embeddings: bool = False, experts: int = 0, ep: int = 1) -> bool:
    """`check_model_shape` as a test (`meshrun plan` lists the layouts that pass)."""
    return (_heads_problem(tp, tp, n_heads, n_kv_heads) is None and pp <= n_layers
            and not (pp > 1 and tie_embeddings) and _experts_problem(experts, ep) is None)


def check_compile(compile_on: bool, tp: int, sequence_parallel: bool, cp: int = 1, experts: int = 0) -> None:
    """torch 2.13: a compiled TP block fed plain tensors loses the DTensor gradient in backward;
    context parallel's ring attention (collectives in an autograd.Function) is not compiled; a
    mixture of experts reads its routing on the host (tokens per expert), which no fullgraph holds."""
    require("train.compile", not (compile_on and tp > 1 and not sequence_parallel),
            "false with parallel.tp > 1 unless parallel.sequence_parallel=true", compile_on)
    require("train.compile", not (compile_on and cp != 1),
            f"false with parallel.cp={cp} (the ring attention runs eagerly)", compile_on)
    require("train.compile", not (compile_on and experts),
            f"false with model.experts={experts} (the experts' routing is read on the host, which one "
            "compiled graph cannot hold; 'auto' trains such a model eagerly)", compile_on)


def check_replica_groups(mode: str, strategy: str, tp: int, pp: int, cp: int = 1) -> None:
    """torchft replica groups (fault.mode) are data-parallel groups, DDP or FSDP (HSDP across the
    groups) inside: no TP, PP or CP."""
    for key, value in (("parallel.tp", tp), ("parallel.pp", pp), ("parallel.cp", cp)):
        if value != 1:
            raise ConfigError(f"{mode} runs data-parallel replica groups only, got {key} = {value}; "
                              f"set {key} = 1, or fault.mode = 'exact'")


def check_lora(rank: int, tp: int, pp: int) -> None:
    """LoRA adapters (lora.rank > 0) train under data parallel (DDP, FSDP, HSDP): peft's LoRA layers
    are plain modules beside the base weight, which tensor parallel's plans do not split and a
    pipeline split does not name."""
    if rank <= 0:
        return
    for key, degree in (("tp", tp), ("pp", pp)):
        if degree > 1:
            raise ConfigError(f"parallel.{key}={degree} with lora.rank={rank}: LoRA trains under data parallel "
                              f"only (ddp, fsdp, hsdp); set parallel.{key}=1 or lora.rank=0")
