"""The layout resolver: every rule through `resolve_layout`, each message naming its key, and each
message written once in src/ (meshrun.parallel.rules*)."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.config import DataSection, ParallelSection, TrainSection, load_config
from meshrun.errors import ConfigError
from meshrun.parallel.resolve import (
    DTYPE_NAMES,
    SCHEDULES,
    ModelShape,
    ParallelOptions,
    check_options,
    resolve_layout,
    stated_degrees,
    torch_dtype,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "meshrun"
RULE_MODULES = re.compile(r"parallel/rules(_\w+)?\.py")  # the modules that own the layout rules
MODEL = ModelShape(n_heads=4, n_kv_heads=2, n_layers=4, tie_embeddings=False)
FSDP = dict(strategy="fsdp", dp_replicate=1, dp_shard=1)


def error(options: ParallelOptions, world: int = 4, model: ModelShape | None = MODEL) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_layout(options, world, model)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- what a resolved layout holds -----------------------------------------------------------------


def test_plain_ddp_needs_no_mesh_and_takes_every_rank():
    layout = resolve_layout(ParallelOptions(), 4, MODEL)
    assert (layout.dims.dp_replicate, layout.dp_size, layout.use_mesh, layout.pipeline) == (4, 4, False, None)
    assert layout.describe() == "ddp: dp_replicate 4 (world 4)"


def test_fsdp_shards_the_ranks_left_and_resolves_dtypes():
    layout = resolve_layout(ParallelOptions(strategy="fsdp", tp=2, dtype="bf16"), 8, MODEL)
    assert layout.dims.degrees == {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2, "pp": 1}
    assert layout.use_mesh and (layout.param_dtype, layout.reduce_dtype) == ("bf16", "fp32")
    assert resolve_layout(ParallelOptions(strategy="fsdp", param_dtype="fp32", dtype="bf16"), 2).param_dtype == "fp32"
    hsdp = resolve_layout(ParallelOptions(strategy="fsdp", dp_replicate=2, dp_shard=-1), 8)
    assert (hsdp.dims.dp_replicate, hsdp.dims.dp_shard) == (2, 4)  # explicit degrees are kept
    assert "\n" not in layout.describe() and layout.describe().startswith("fsdp: dp_shard 4 x tp 2 (world 8)")


def test_ddp_with_pipeline_goes_over_the_mesh_with_a_checked_plan():
    layout = resolve_layout(ParallelOptions(pp=2, pp_schedule="interleaved_1f1b", batch_size=8), 4, MODEL)
    assert layout.use_mesh and layout.dims.degrees == {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 2}
    plan = layout.pipeline
    assert (plan.num_stages, plan.stages_per_rank, plan.microbatches) == (4, 2, 4)
    assert plan.layers == [["0"], ["1"], ["2"], ["3"]]
    assert "pipeline interleaved_1f1b, 4 stages (2 per rank), 4 micro-batches" in layout.describe()
    no_model = resolve_layout(ParallelOptions(pp=2, batch_size=8), 2, None)
    assert no_model.pipeline.layers == []  # checks only; the build resolves again with the model


def test_options_from_config_equal_the_sections_and_defaults_agree():
    cfg = load_config(None, ["parallel.strategy=fsdp", "parallel.tp=2", "train.batch_size=4", "train.dtype=bf16"])
    options = ParallelOptions.from_config(cfg)
    assert (options.strategy, options.tp, options.batch_size, options.dtype) == ("fsdp", 2, 4, "bf16")
    assert options.seq_len == cfg.data.seq_len  # the [data] key a layout reads (context parallel)
    defaults = {f.name: f.default for cls in (ParallelSection, TrainSection, DataSection) for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(ParallelOptions):
        if f.name != "seq_len":  # 0 = not known: the sequence rules wait for a [data] section
            assert f.default == defaults[f.name], f.name  # ParallelOptions() is the default config's layout
    assert set(f.name for f in dataclasses.fields(ParallelSection)) < set(defaults)
    assert ParallelOptions.from_sections(cfg.parallel) == dataclasses.replace(
        options, batch_size=16, dtype="fp32", seq_len=0)


def test_model_shape_from_args_and_modules():
    from meshrun.models.llama import ModelArgs, Transformer

    args = ModelArgs(vocab_size=32, dim=16, n_layers=3, n_heads=2, max_seq_len=8)
    assert ModelShape.from_args(args) == ModelShape(n_heads=2, n_kv_heads=2, n_layers=3, tie_embeddings=args.tie_embeddings,
                                                    experts=0)  # the built-in model says it has none
    assert ModelShape.from_model(Transformer(args, seed=0)) == ModelShape.from_args(args)
    assert ModelShape.from_args(object()) == ModelShape()  # a user model that says nothing


def test_stated_degrees_need_no_world_size():
    assert stated_degrees(ParallelOptions(strategy="fsdp")) == {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1}
    assert stated_degrees(ParallelOptions()) == {"dp_replicate": -1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1}


def test_dtype_table():
    import torch

    assert DTYPE_NAMES == ("fp32", "bf16", "fp16")
    assert [torch_dtype(n) for n in DTYPE_NAMES] == [torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ConfigError, match="dtype must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"):
        torch_dtype("fp8")


# -- every rule, through the one call: each message names its key ---------------------------------

RULES = [
    # (options, world, message fragment)
    (dict(strategy="zero"), 4, "parallel.strategy must be one of 'ddp', 'fsdp', got 'zero'"),
    (dict(tp=0), 4, "parallel.tp must be an integer >= 1 or -1 (the ranks left), got 0"),
    (dict(pp=True), 4, "parallel.pp must be an integer >= 1 or -1 (the ranks left), got true"),
    (dict(strategy="fsdp", dp_replicate=-1, dp_shard=-1), 4,
     "only one of parallel.dp_replicate, parallel.dp_shard, parallel.cp, parallel.tp, parallel.pp may be -1, got -1 for dp_replicate, dp_shard"),
    (dict(tp=2), 4, "parallel.tp must be 1 with parallel.strategy = 'ddp' (it only replicates), got 2"),
    (dict(dp_shard=2), 4, "parallel.dp_shard must be 1 with parallel.strategy = 'ddp'"),
    (dict(pp_schedule="zbv"), 4, "parallel.pp_schedule must be one of 'gpipe', '1f1b', "),
    (dict(pp_microbatches=-1), 4, "parallel.pp_microbatches must be >= 0 (0 = one per stage), got -1"),
    (dict(pp_stages_per_rank=-1), 4, "parallel.pp_stages_per_rank must be >= 0"),
    (dict(pp_split_points=3), 4, "parallel.pp_split_points must be a string"),
    (dict(param_dtype="fp8"), 4, "parallel.param_dtype must be one of 'auto', 'fp32', 'bf16', 'fp16', got 'fp8'"),
    (dict(reduce_dtype="auto"), 4, "parallel.reduce_dtype must be one of 'fp32', 'bf16', 'fp16', got 'auto'"),
    (dict(batch_size=0), 4, "train.batch_size must be >= 1, got 0"),
    (dict(grad_accum=0), 4, "train.grad_accum must be >= 1, got 0"),
    (dict(dtype="fp8"), 4, "train.dtype must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"),
    (dict(dtype="fp16", pp=2), 4, "train.dtype='fp16' needs a loss scale, which the pipeline schedule of parallel.pp=2"),
    (dict(strategy="fsdp", param_dtype="fp16", dtype="bf16"), 4,
     "parallel.param_dtype='fp16' computes in fp16 without a gradient scaler under train.dtype='bf16'"),
    (dict(strategy="fsdp", sequence_parallel=True), 4,
     "parallel.sequence_parallel=true splits over tensor-parallel ranks, but parallel.tp=1"),
    (dict(strategy="fsdp", sequence_parallel=True, loss_parallel=True), 4,
     "parallel.sequence_parallel=true and parallel.loss_parallel=true split over tensor-parallel ranks"),
    (dict(**FSDP, tp=2, pp=2, loss_parallel=True), 4,
     "parallel.loss_parallel=true does not compose with parallel.pp=2"),
    (dict(cp=2), 4, "parallel.cp=2 shards the parameters over the data and context ranks together (FSDP over "
     "dp_shard x cp), which parallel.strategy = 'ddp' does not do; set parallel.strategy = 'fsdp'"),
    (dict(strategy="fsdp", cp=2, seq_len=10), 4,
     "data.seq_len=10 must divide into 2 x parallel.cp = 4 equal chunks (head-tail load balancing gives each "
     "cp rank two); e.g. data.seq_len=8 or 12"),
    (dict(ep=0), 4, "parallel.ep must be an integer >= 1 (1 = off), got 0"),
    (dict(ep=2), 4, "parallel.ep=2 splits the experts over data-parallel shard ranks (FSDP), which "
     "parallel.strategy = 'ddp' does not have; set parallel.strategy = 'fsdp'"),
    (dict(strategy="fsdp", cp=2, ep=2), 4, "parallel.ep=2 with parallel.cp=2: expert parallel over "
     "context-parallel ranks is not supported yet"),
    (dict(**dict(FSDP, dp_shard=6), ep=4), 6, "parallel.ep=4 must divide parallel.dp_shard=6 (expert "
     "parallel borrows data-parallel shard ranks); valid: 1, 2, 3, 6"),
    # -- the rules above need no world size (check_options); those below do
    (dict(strategy="fsdp", ep=4, pp=2), 4, "parallel.ep=4 must divide parallel.dp_shard=2"),  # dp_shard from the world
    (dict(**dict(FSDP, dp_shard=2), tp=2, pp=-1, loss_parallel=True, batch_size=8), 8,
     "parallel.loss_parallel=true does not compose with parallel.pp=2"),  # pp known only with the world
    (dict(), 0, "world size must be an integer >= 1, got 0"),
    (dict(strategy="fsdp", dp_replicate=1, dp_shard=-1, tp=3), 4,
     "parallel.dp_shard=-1 takes the ranks left, but parallel.tp=3 = 3 does not divide the world size 4"),
    (dict(dp_replicate=1, pp=2), 4,
     "parallel.dp_replicate=1 x parallel.dp_shard=1 x parallel.cp=1 x parallel.tp=1 x parallel.pp=2 = 2 does not equal "
     "the world size 4; e.g. parallel.dp_replicate=2 or parallel.pp=4, or set one degree to -1"),  # ddp: no dp_shard/cp/tp fixes
    (dict(**FSDP, pp=2), 4, "e.g. parallel.dp_replicate=2 or parallel.dp_shard=2 or parallel.cp=2 or parallel.tp=2 or parallel.pp=4"),
    (dict(strategy="fsdp", dp_replicate=1, dp_shard=1, cp=-1, seq_len=12), 4,
     "data.seq_len=12 must divide into 2 x parallel.cp = 8 equal chunks"),  # cp known only with the world
    (dict(**FSDP, tp=4), 4, "parallel.tp=4 does not divide model.n_kv_heads=2; valid: 1, 2"),
    (dict(**FSDP, tp=8), 8, "parallel.tp=8 does not divide model.n_heads=4; valid: 1, 2"),
    (dict(dp_replicate=1, pp=8), 8, "parallel.pp=8 exceeds model.n_layers=4 (a stage needs at least one block); valid: 1, 2, 4"),
    (dict(pp=4, pp_schedule="interleaved_1f1b"), 4, "parallel.pp=4 x 2 stages per rank = 8 stages exceeds model.n_layers=4"),
    (dict(pp=2, pp_schedule="interleaved_zero_bubble"), 4,
     "parallel.pp_schedule='interleaved_zero_bubble' does not train correctly with data parallel (2 dp ranks)"),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=1), 4,
     "parallel.pp_schedule='interleaved_1f1b' interleaves several stages per rank, but parallel.pp_stages_per_rank=1"),
    (dict(pp=2, pp_schedule="1f1b", pp_stages_per_rank=2), 4,
     "parallel.pp_schedule='1f1b' runs one stage per rank, but parallel.pp_stages_per_rank=2"),
    (dict(pp=2, pp_split_points="x"), 4, "parallel.pp_split_points='x': 'x' is not a block index"),
    (dict(pp=2, pp_split_points="1,2"), 4, "parallel.pp_split_points='1,2' gives 3 stages, but the layout has 2"),
    (dict(pp=2, pp_split_points="4"), 4, "parallel.pp_split_points='4' must be increasing block indices in 1..3"),
    (dict(pp=2, pp_microbatches=3, batch_size=8), 4,
     "parallel.pp_microbatches=3 does not divide train.batch_size=8; valid: 1, 2, 4, 8"),
    (dict(pp=2, pp_schedule="1f1b", pp_microbatches=1), 4,
     "parallel.pp_schedule='1f1b' needs parallel.pp_microbatches >= the 2 stages, got 1"),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_microbatches=5, batch_size=10), 4,
     "parallel.pp_microbatches=5 must be a multiple of parallel.pp=2 (or at most 2) for 'interleaved_1f1b'"),
]

OPTION_RULES = 26


@pytest.mark.parametrize(("kwargs", "world", "expected"), RULES, ids=[r[2][:50] for r in RULES])
def test_every_rule_is_one_config_error_naming_its_key(kwargs, world, expected):
    assert expected in error(ParallelOptions(**kwargs), world)


def test_tied_embeddings_are_refused_under_pp_only():
    tied = dataclasses.replace(MODEL, tie_embeddings=True)
    assert "model.tie_embeddings=true" in error(ParallelOptions(pp=2), 2, tied)
    resolve_layout(ParallelOptions(), 2, tied)


def test_expert_parallel_borrows_dp_shard_and_divides_the_experts():
    layout = resolve_layout(ParallelOptions(strategy="fsdp", ep=2), 4, dataclasses.replace(MODEL, experts=4))
    assert (layout.dims.dp_shard, layout.dims.ep, layout.dims.efsdp, layout.dp_size) == (4, 2, 2, 4)
    assert "ep 2 (of dp_shard)" in layout.describe()
    assert ("model.experts=6 is not divisible by parallel.ep=4 (each ep rank holds experts / ep of them); "
            "valid parallel.ep: 1, 2, 3, 6") in error(ParallelOptions(strategy="fsdp", ep=4), 4,
                                                      dataclasses.replace(MODEL, experts=6))
    assert "parallel.ep=2 splits routed experts, but the model has none" in error(
        ParallelOptions(strategy="fsdp", ep=2), 4, dataclasses.replace(MODEL, experts=0))
    resolve_layout(ParallelOptions(strategy="fsdp", ep=2), 4, MODEL)  # experts unknown: checked at build
    with pytest.raises(ConfigError, match="parallel.ep=2 splits the routed experts of the built-in model and of "
                                          "model.hf; model.factory='pkg.mod:fn' is not split"):
        load_config(None, ["parallel.strategy=fsdp", "parallel.ep=2", "model.factory=pkg.mod:fn"])
    assert load_config(None, ["parallel.strategy=fsdp", "parallel.ep=2"]).parallel.ep == 2
    with pytest.raises(ConfigError, match="parallel.ep=2 splits the experts over data-parallel shard ranks"):
        load_config(None, ["parallel.ep=2"])


def test_model_rules_are_skipped_without_a_shape():
    resolve_layout(ParallelOptions(strategy="fsdp", tp=4), 4, None)  # a user model: checked at build
    resolve_layout(ParallelOptions(strategy="fsdp", tp=4), 4, ModelShape(n_layers=2))


def test_check_options_runs_the_world_independent_rules_and_config_validation_uses_it():
    check_options(ParallelOptions(strategy="fsdp", dp_replicate=1, tp=-1, sequence_parallel=True))  # tp not known yet
    for kwargs, _, expected in RULES[:OPTION_RULES]:
        with pytest.raises(ConfigError, match=None) as info:
            check_options(ParallelOptions(**kwargs))
        assert expected in str(info.value)
    for kwargs, _, _ in RULES[OPTION_RULES:]:
        check_options(ParallelOptions(**kwargs))  # these need the world size or the model
    with pytest.raises(ConfigError, match="parallel.sequence_parallel=true splits over tensor-parallel ranks"):
        load_config(None, ["parallel.sequence_parallel=true"])


def test_resolve_imports_no_torch():
    code = ("import sys; from meshrun.config import load_config; "
            "from meshrun.parallel.resolve import ParallelOptions, resolve_layout; "
            "resolve_layout(ParallelOptions.from_config(load_config(None, ['parallel.strategy=fsdp'])), 4); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# -- one rule, one place --------------------------------------------------------------------------

# Distinctive pieces of every layout message, as written in the source.
MESSAGES = [
    "needs a loss scale, which the pipeline schedule",
    "computes in fp16 without a gradient scaler",
    "cannot update FSDP/TP parameter shards",
    "an integer >= 1 or -1 (the ranks left)",
    "world size must be an integer >= 1",
    "may be -1, ",
    "(it only replicates)",
    "takes the ranks left, but",
    "does not equal the world size",
    "over tensor-parallel ranks",
    "stages send plain tensors)",
    "does not divide model.",
    "least one block)",
    "would split the shared",
    "does not train correctly with data",
    "interleaves several stages per rank",
    "runs one stage per rank",
    "block index; write e.g.",
    "but the layout has",
    "must be increasing block",
    "does not divide train.batch_size=",
    "needs parallel.pp_microbatches >= the",
    "must be a multiple of parallel.pp=",
    "ranks together (FSDP over dp_shard x cp)",
    "cannot split the attention of model.hf=",
    "(head-tail load balancing gives each",
    "splits the sequence of the built-in model and model.hf models",
    "(the ring attention runs eagerly)",
    "an integer >= 1 (1 = off)",
    "splits the experts over data-parallel shard ranks",
    "expert parallel over context-parallel",
    "(expert parallel borrows",
    "is not divisible by parallel.ep=",
    "splits routed experts, but the model has none",
    "splits the routed experts of the built-in model and of model.hf;",
]
# ConfigErrors outside rules.py that name a parallel key but are no layout rule: misuse of the build
# API (parallelize.py), and `meshrun plan --show` asking for its --world flag.
API_ERRORS = ("needs a DeviceMesh", "a pipeline needs parallelize_pipeline", "--show needs --world")


def _sources() -> dict[Path, str]:
    return {path: path.read_text(encoding="utf-8") for path in sorted(SRC.rglob("*.py"))}


@pytest.mark.parametrize("fragment", MESSAGES)
def test_each_layout_message_is_written_once_in_rules(fragment):
    where = [(path.relative_to(SRC).as_posix(), text.count(fragment))
             for path, text in _sources().items() if fragment in text]
    assert len(where) == 1 and where[0][1] == 1, where  # once, in one of the parallel/rules*.py modules
    assert RULE_MODULES.fullmatch(where[0][0]), where


def _message_text(node: ast.Raise) -> str:
    parts = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            parts.append(sub.value)
    return "".join(parts)


def test_no_config_error_outside_rules_names_a_parallel_key():
    found = []
    for path, text in _sources().items():
        if RULE_MODULES.fullmatch(path.relative_to(SRC).as_posix()):
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", None) == "ConfigError"):
                message = _message_text(node)
                if "parallel." in message and not any(ok in message for ok in API_ERRORS):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: {message[:80]}")
    assert not found, found


def test_schedules_are_the_configs_choices():
    for name in SCHEDULES:
        check_options(ParallelOptions(pp_schedule=name))
