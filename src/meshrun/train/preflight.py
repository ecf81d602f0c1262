"""Every check `meshrun train` makes before a worker starts, in the order a user's mistakes are found.

cli/train.py reads the command line: its flags, the config file and each key's type and range
(meshrun.config), `--resume STEP` and `--profile`, and every launch option (launch/checks.py).
Then this module, in this order; the first problem is one MeshrunError line naming the key, the
value and the fix (exit 2):

  check_before_torch   no torch, creates nothing: a fraction of a second (benchmarks/reject_time.py)
    1. train.run_dir (and train.name) can be created
    2. the files the config names exist: data.path, model.init_from, data.tokenizer
    3. each [metrics] tracker's extra is installed
    4. model.hf: a directory with a readable, supported config.json, and data.seq_len within it
    5. model.factory names a module that can be found (not run) outside the standard library
    6. the model fits this node's memory by `meshrun plan`'s estimate
    7. [fault] mode = "torchft": its layout rules, dtype, one host, and its extra;
       lora.rank > 0: its extra (peft)
  check_with_torch     torch imported, still no process group
    8. --nproc-per-node resolves to a count
    9. the tokenizer loads; data.path reads and holds enough tokens for a train and an eval sample;
       data.packing: it holds examples, none longer than a sequence, and model.hf masks them apart
   10. model.factory runs and returns a torch.nn.Module (on the meta device when it can)
   11. the whole layout for this world (parallel/resolve.py), and model.hf's TP plan
   12. train.compile = true has a C++ compiler and a layout it can compile
   13. --resume PATH and model.init_from fit this model's names and shapes (built on meta);
       model.hf's safetensors are regular files with valid headers and floating-point tensors

After them cli/train.py checks the log directory and takes the run directory's lock.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterator

from meshrun.config import JobConfig
from meshrun.config.base import fmt
from meshrun.config.fault_section import TORCHFT, is_torchft
from meshrun.config.sections import MOE_COUNT_KEYS
from meshrun.config.trackers import check_trackers_installed
from meshrun.errors import ConfigError, MeshrunError
from meshrun.extras import missing_extra_message
from meshrun.launch.args import fixed_world_size, parse_nnodes, resolve_nproc_per_node
from meshrun.runtime.device import auto_nproc_per_node
from meshrun.writable import check_creatable_dir

GIB = 2**30
# A GPU's memory is not known without torch: count each /dev/nvidiaN as the largest GPU made,
# so that only a model no machine of this size could hold is refused here.
GPU_MEMORY_BOUND = 288 * GIB
PLANNER_MAX_LAYERS = 4096  # deeper models: the closed-form lower bound only (the planner loops per block)
SIZE_KEYS = ("name", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len",
             *MOE_COUNT_KEYS)  # the keys a too-large model's line names when set


def check_before_torch(cfg: JobConfig, *, nproc_per_node: str = "auto", nnodes: str = "1") -> None:
    """Checks 1-7 (see the module doc): what needs the machine but not torch."""
    fix = "set train.run_dir to a directory you can write (e.g. --set train.run_dir=runs)"
    check_creatable_dir(cfg.train.run_dir, "train.run_dir", fix=fix)
    if cfg.train.name:
        check_creatable_dir(os.path.join(cfg.train.run_dir, cfg.train.name), "train.run_dir/train.name",
                            fix="choose a shorter train.name")
    _check_files(cfg)
    check_trackers_installed(cfg.metrics.tracker_names)  # a missing extra: one line before any worker
    if cfg.model.hf:
        check_hf_dir(cfg)
    if cfg.model.factory:
        check_factory_module(cfg.model.factory)
    else:
        check_memory(cfg, nproc_per_node=nproc_per_node, nnodes=nnodes)
    check_fault(cfg, nnodes=nnodes)
    if cfg.lora.enabled and importlib.util.find_spec("peft") is None:
        raise ConfigError(missing_extra_message("peft", f"lora.rank={cfg.lora.rank}"))


def check_with_torch(cfg: JobConfig, *, nproc_per_node: str, nnodes: str = "1") -> None:
    """Checks 8-13 (see the module doc): what would otherwise fail on every rank."""
    from meshrun.data.tokenizer import load_tokenizer

    resolve_nproc_per_node(str(nproc_per_node))  # 0 or garbage: a LaunchError naming the flag
    with _naming("data.tokenizer", cfg.data.tokenizer):
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    if cfg.data.path:
        from meshrun.data.loader import effective_val_fraction, load_data_tokens
        from meshrun.data.split import split_sizes

        with _naming("data.path", cfg.data.path):
            tokens, prepared_val = load_data_tokens(cfg.data.path, tokenizer)  # missing or corrupt: DataError
            split_sizes(len(tokens), effective_val_fraction(cfg.data, prepared_val), cfg.data.seq_len)  # too small
    if cfg.data.packing:  # no examples to pack (text, the built-in corpus), or one longer than a sequence
        from meshrun.data.loader import load_examples
        from meshrun.data.packing import pack_examples

        pack_examples(load_examples(cfg.data.path), cfg.data.seq_len)
    if cfg.model.factory:
        check_factory_builds(cfg, tokenizer.vocab_size)
    if cfg.model.hf and cfg.data.packing:  # transformers' own class decides (built on meta)
        from meshrun.models.factory import build_model
        from meshrun.models.meta import on_meta

        with on_meta():
            build_model(cfg.model, tokenizer.vocab_size, seed=0).check_packing()
    _check_layout(cfg, tokenizer.vocab_size, nproc_per_node, nnodes)
    experts = 0
    if not (cfg.model.factory or cfg.model.hf):  # the built-in decoder: a mixture of experts' own refusals
        from meshrun.models.from_config import model_args_from_config
        from meshrun.models.moe import check_training

        args = model_args_from_config(cfg.model, tokenizer.vocab_size)
        check_training(args, dtype=cfg.train.dtype, fault_mode=cfg.fault.mode)
        experts = args.experts
    if cfg.train.compile:  # true without a C++ compiler or in a layout it breaks: one line here ("auto" warns on the workers)
        from meshrun.parallel.compile import check_compiler, layout_allows

        check_compiler(True)
        layout_allows(True, cfg.parallel.tp, cfg.parallel.sequence_parallel, cfg.parallel.cp, experts)
    _check_checkpoints(cfg, tokenizer.vocab_size)
    if cfg.lora.enabled:  # imported once here: the workers fork from this process (launch/preload.py)
        import peft  # noqa: F401


def _check_checkpoints(cfg: JobConfig, vocab_size: int) -> None:
    """--resume PATH, model.init_from and model.hf's safetensors against this model's names and
    shapes, built on the meta device by the checks (shapes only; no weight is loaded)."""
    from meshrun.checkpoint.export import check_init_from
    from meshrun.checkpoint.verify import check_resume
    from meshrun.models.factory import build_model

    def model_to_check():
        return build_model(cfg.model, vocab_size, seed=0)

    def resumed_model():  # a LoRA run's checkpoint holds its adapters (models/lora.py)
        if not cfg.lora.enabled:
            return model_to_check()
        from meshrun.models.lora import apply_lora

        return apply_lora(model_to_check(), cfg.lora)

    check_resume(cfg.checkpoint.resume, resumed_model, adapters_only=cfg.lora.enabled)
    check_init_from(cfg.model.init_from, model_to_check)
    if cfg.model.hf:
        from meshrun.models.hf_load import check_hf_weights, hf_state_dict
        from meshrun.models.meta import on_meta

        with on_meta():  # shapes only: on a real device the build would load the very files checked here
            expected = {name: tuple(t.shape) for name, t in hf_state_dict([model_to_check()]).items()}
        check_hf_weights(cfg.model.hf, expected)


def check_hf_dir(cfg: JobConfig) -> None:
    """model.hf: its config.json, architecture and weights (models/hf_config.py), and data.seq_len
    within its max_position_embeddings (its RoPE tables and masks end there); under parallel.cp an
    attention the ring computes."""
    from meshrun.models.hf_config import check_hf_context_parallel, check_hf_seq_len

    check_hf_seq_len(cfg.model.hf, cfg.data.seq_len)
    check_hf_context_parallel(cfg.model.hf, cfg.parallel.cp)


def check_fault(cfg: JobConfig, *, nnodes: str = "1") -> None:
    """One ConfigError line for a torchft job that cannot run as configured; exact mode passes."""
    if not is_torchft(cfg):
        return
    mode = "fault.mode = 'torchft'"
    from meshrun.parallel.rules import check_replica_groups

    check_replica_groups(mode, cfg.parallel.strategy, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp)
    if cfg.train.dtype == "fp16":
        raise ConfigError(f"{mode} does not take train.dtype = 'fp16' (a group's skipped overflow steps "
                          "would not match its peers'); use 'bf16' or 'fp32', or fault.mode = 'exact'")
    if nnodes.split(":")[-1] != "1":
        raise ConfigError(f"{mode} runs its replica groups on one host for now, got --nnodes {nnodes}; "
                          "use --nnodes 1, or fault.mode = 'exact'")
    if importlib.util.find_spec(TORCHFT) is None:
        raise ConfigError(missing_extra_message(TORCHFT, mode))



def _check_files(cfg: JobConfig) -> None:
    for key, path, kind in (("data.path", cfg.data.path, "a token directory or a .txt file"),
                            ("model.init_from", cfg.model.init_from, "a weights file"),
                            ("data.tokenizer", "" if cfg.data.tokenizer == "byte" else cfg.data.tokenizer,
                             "'byte', a tokenizer directory or a tokenizer.json file")):
        if path and not os.path.exists(path):
            raise ConfigError(f"{key}={fmt(path)} not found; give {kind} (relative to {os.getcwd()})")


def check_factory_module(spec: str) -> None:
    """`model.factory` names a module that can be found (not run) and is not the standard library."""
    module, _, _ = spec.partition(":")
    top = module.split(".")[0]
    where = f"model.factory={fmt(spec)}"
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        raise ConfigError(f"{where}: {top!r} is Python's standard library, not a model; point it at your "
                          f"function that returns a torch.nn.Module, e.g. model.factory='mymodels:build'")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    except Exception as exc:  # noqa: BLE001 - a parent package failed while importing
        raise ConfigError(f"{where}: cannot import {module!r} ({type(exc).__name__}: {exc})") from None
    if found is None and "." not in module:  # models/factory.py retries with the working directory
        found = importlib.machinery.PathFinder.find_spec(module, [os.getcwd()])
    if found is None:
        raise ConfigError(f"{where}: no module {module!r} on the Python path; check the spelling, "
                          f"or run from the directory that holds it (e.g. mymodels.py:build -> 'mymodels:build')")


def check_memory(cfg: JobConfig, *, nproc_per_node: str, nnodes: str) -> None:
    """Refuse a model whose training state cannot fit this node by the planner's estimate."""
    from meshrun.models.from_config import model_args_from_config

    try:
        args = model_args_from_config(cfg.model, _vocab_size(cfg))
    except MeshrunError as exc:
        raise ConfigError(str(exc)) from None
    local, world = launch_ranks(nproc_per_node, nnodes)
    available = machine_memory()
    # Lower bound for any layout: params + grads + AdamW's two moments (16 bytes each), spread
    # over every rank of the job, this node holding its share.
    lower = 16 * args.num_params() * local // world
    need, how = lower, f"at least {_gib(lower)} of weights, gradients and AdamW state"
    if lower <= available and args.n_layers <= PLANNER_MAX_LAYERS:
        per_rank = _planner_estimate(cfg, args, world)
        if per_rank is not None:
            need = per_rank * local
            how = f"{_gib(need)} ({local} rank(s) x {_gib(per_rank)} by `meshrun plan`'s estimate)"
    if need > available:
        sizes = [f"model.{k}={fmt(getattr(cfg.model, k))}" for k in SIZE_KEYS
                 if getattr(cfg.model, k) not in (0, "") and (k != "name" or cfg.model.name != "tiny")]
        shown = ", ".join((sizes or [f"model.name={fmt(cfg.model.name)}"])
                          + [f"train.batch_size={cfg.train.batch_size}", f"data.seq_len={cfg.data.seq_len}"])
        raise ConfigError(f"{shown}: training needs {how} on this node, more than its {_gib(available)}; "
                          f"use a smaller model (e.g. model.name='tiny'), batch or sequence, fewer ranks per node or more nodes")


def _vocab_size(cfg: JobConfig) -> int | None:
    """A lower bound of the vocabulary without loading the tokenizer (meshrun.data imports torch):
    the config's own, else a byte tokenizer's 256 (a tokenizer.json has more). The real check of
    the two is the preflight's, once torch is loaded."""
    return None if cfg.model.vocab_size else 256


def launch_ranks(nproc_per_node: str, nnodes: str) -> tuple[int, int]:
    """(ranks on this node, ranks in the job) as far as known without torch: an elastic MIN:MAX
    node count at its MAX, `auto` as this machine's."""
    text = str(nproc_per_node).strip()
    local = int(text) if text.isdigit() else auto_nproc_per_node(import_torch=False)
    return local, local * parse_nnodes(nnodes)[1]


def _planner_estimate(cfg: JobConfig, args, world: int) -> int | None:
    """Per-rank bytes of the config's layout (meshrun.plan.estimate); None when the layout is
    not decided yet (the layout check says why, later)."""
    from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
    from meshrun.plan.memory import estimate

    try:
        layout = resolve_layout(ParallelOptions.from_config(cfg), world, ModelShape.from_args(args))
    except MeshrunError:
        return None
    extra = {}
    if layout.pipeline is not None:
        extra = {"pp_schedule": layout.pipeline.schedule, "pp_microbatches": layout.pipeline.microbatches,
                 "pp_stages_per_rank": layout.pipeline.stages_per_rank}
    try:
        est = estimate(args, layout.dims, batch_size=cfg.train.batch_size, seq_len=cfg.data.seq_len,
                       dtype=cfg.train.dtype, activation_checkpointing=cfg.train.activation_checkpointing,
                       sequence_parallel=cfg.parallel.sequence_parallel,
                       loss_parallel=cfg.parallel.loss_parallel, **extra)
    except MeshrunError:
        return None
    return est.total


def machine_memory() -> int:
    """Bytes this node could hold: RAM, plus a generous bound per GPU device (see GPU_MEMORY_BOUND)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return sys.maxsize
    try:
        gpus = len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
    except OSError:
        gpus = 0
    return ram + gpus * GPU_MEMORY_BOUND


def _gib(n: int) -> str:
    return f"{n / GIB:,.1f} GiB" if n < 10**6 * GIB else f"{n / GIB:.3g} GiB"


@contextlib.contextmanager
def _naming(key: str, value: str) -> Iterator[None]:
    """A MeshrunError from reading `value` names the config key it came from."""
    try:
        yield
    except MeshrunError as exc:
        if key in str(exc):
            raise
        try:
            named = type(exc)(f"{key}={value!r}: {exc}")
        except TypeError:  # a subclass with another constructor: the base class says it as well
            named = MeshrunError(f"{key}={value!r}: {exc}")
        raise named from None


def check_factory_builds(cfg: JobConfig, vocab_size: int) -> None:
    """`model.factory` imports and returns a torch.nn.Module, built as the workers will build it
    (on the meta device when it can be, so no weights are allocated), before any worker starts.
    The module was found without running it (check_factory_module); here its code runs, once."""
    import dataclasses

    from meshrun.errors import ModelError
    from meshrun.models.factory import build_model, load_factory
    from meshrun.models.meta import on_meta

    load_factory(cfg.model.factory)  # does it import, and name a callable?
    model_cfg = dataclasses.replace(cfg.model, init_from="")  # weights are the checkpoint checks' job
    try:
        with on_meta():
            build_model(model_cfg, vocab_size, seed=0)
        return
    except ModelError:
        raise
    except Exception:  # noqa: BLE001 - it may need real tensors: build it as the workers would
        pass
    try:
        build_model(model_cfg, vocab_size, seed=0)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code: one line, not N tracebacks
        text = " ".join(str(exc).split())[:160]
        raise ModelError(f"model.factory={cfg.model.factory!r} failed to build the model "
                         f"({type(exc).__name__}: {text}); it must return a torch.nn.Module") from None


def _check_layout(cfg: JobConfig, vocab_size: int, nproc_per_node: str, nnodes: str) -> None:
    """The whole layout (`resolve_layout`) for the world these launch options give, before any
    process group exists; with no fixed world, the rules that need none."""
    from meshrun.parallel.resolve import ParallelOptions, check_options, resolve_layout

    options = ParallelOptions.from_config(cfg)
    world = fixed_world_size(resolve_nproc_per_node(str(nproc_per_node)), str(nnodes))
    if world is None:
        check_options(options)  # cpu/gpu counts or an elastic MIN:MAX world: the rest on the workers
        return
    model = None
    if not cfg.model.factory:  # the user's model: its shape is checked on the workers
        from meshrun.models.from_config import model_args_from_config, model_shape_from_config

        model = model_shape_from_config(cfg.model, model_args_from_config(cfg.model, vocab_size))
    layout = resolve_layout(options, world, model)
    if cfg.model.hf and (layout.dims.tp > 1 or layout.dims.pp > 1):
        # what the architecture's structure allows, from transformers' own build on meta
        from meshrun.models.factory import build_model
        from meshrun.models.meta import on_meta

        if options.sequence_parallel:
            from meshrun.parallel.rules import check_hf_tp

            check_hf_tp(cfg.model.hf, True, {}, ())
        with on_meta():
            build_model(cfg.model, vocab_size, seed=0).check_layout(layout.dims.tp, layout.dims.pp)
