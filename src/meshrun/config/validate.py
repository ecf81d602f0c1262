"""Feasibility of a typed JobConfig on this machine, checked before torch is imported.

The sections (sections.py) check each value's type and range; `check_job` checks what needs the
machine: the run directory can be created, files named by the config exist, the model fits in
memory by the planner's estimate (meshrun.plan), and `model.factory` names an importable module
that is not Python's standard library. It creates nothing, imports no torch and runs no user code
(find_spec only). Every problem is one ConfigError line naming the key, the value and the fix.

    check_job(cfg, nproc_per_node="2", nnodes="1")
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

from meshrun.config.base import fmt
from meshrun.config.sections import JobConfig
from meshrun.config.trackers import check_trackers_installed
from meshrun.errors import ConfigError, MeshrunError
from meshrun.writable import check_creatable_dir

GIB = 2**30
# A GPU's memory is not known without torch: count each /dev/nvidiaN as the largest GPU made,
# so that only a model no machine of this size could hold is refused here.
GPU_MEMORY_BOUND = 288 * GIB
PLANNER_MAX_LAYERS = 4096  # deeper models: the closed-form lower bound only (the planner loops per block)
SIZE_KEYS = ("name", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len")


def check_job(cfg: JobConfig, *, nproc_per_node: str = "auto", nnodes: str = "1") -> None:
    """Raise one MeshrunError line for what cannot work on this machine (see the module doc)."""
    fix = "set train.run_dir to a directory you can write (e.g. --set train.run_dir=runs)"
    check_creatable_dir(cfg.train.run_dir, "train.run_dir", fix=fix)
    if cfg.train.name:
        check_creatable_dir(os.path.join(cfg.train.run_dir, cfg.train.name), "train.run_dir/train.name",
                            fix="choose a shorter train.name")
    _check_files(cfg)
    check_trackers_installed(cfg.metrics.tracker_names)  # a missing extra: one line before any worker
    if cfg.model.factory:
        check_factory_module(cfg.model.factory)
    else:
        check_memory(cfg, nproc_per_node=nproc_per_node, nnodes=nnodes)


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
    local, world = _ranks(nproc_per_node, nnodes)
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


def _ranks(nproc_per_node: str, nnodes: str) -> tuple[int, int]:
    """(ranks on this node, ranks in the job) as far as known without torch."""
    from meshrun.launch.args import auto_nproc_per_node, parse_nnodes

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

