"""Checks `meshrun train` runs before starting any worker, so bad input costs one line, not N tracebacks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from meshrun.config import JobConfig
from meshrun.errors import MeshrunError
from meshrun.parallel.compile import check_compiler, layout_allows
from meshrun.parallel.resolve import ModelShape, ParallelOptions, check_options, resolve_layout


def preflight(cfg: JobConfig, *, nproc_per_node: str, nnodes: str = "1") -> None:
    """Raise a one-line MeshrunError for what would otherwise fail on every rank."""
    from meshrun.data.tokenizer import load_tokenizer
    from meshrun.launch.args import resolve_nproc_per_node

    resolve_nproc_per_node(str(nproc_per_node))  # 0 or garbage: a LaunchError naming the flag
    with _naming("data.tokenizer", cfg.data.tokenizer):
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    if cfg.data.path:
        from meshrun.data.loader import effective_val_fraction, load_data_tokens
        from meshrun.data.split import split_sizes

        with _naming("data.path", cfg.data.path):
            tokens, prepared_val = load_data_tokens(cfg.data.path, tokenizer)  # missing or corrupt: DataError
            split_sizes(len(tokens), effective_val_fraction(cfg.data, prepared_val), cfg.data.seq_len)  # too small
    if cfg.model.factory:
        check_factory_builds(cfg, tokenizer.vocab_size)
    _check_layout(cfg, tokenizer.vocab_size, nproc_per_node, nnodes)
    if cfg.train.compile:  # true without a C++ compiler or in a layout it breaks: one line here ("auto" warns on the workers)
        check_compiler(True)
        layout_allows(True, cfg.parallel.tp, cfg.parallel.sequence_parallel)


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
    The module was found without running it (config/validate.py); here its code runs, once."""
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
    from meshrun.launch.args import resolve_nproc_per_node

    options = ParallelOptions.from_config(cfg)
    world = fixed_world_size(resolve_nproc_per_node(str(nproc_per_node)), str(nnodes))
    if world is None:
        check_options(options)  # cpu/gpu counts or an elastic MIN:MAX world: the rest on the workers
        return
    model = None
    if not cfg.model.factory:  # the user's model: its shape is checked on the workers
        from meshrun.models.from_config import model_args_from_config

        model = ModelShape.from_args(model_args_from_config(cfg.model, vocab_size))
    layout = resolve_layout(options, world, model)
    if cfg.model.hf and layout.dims.tp > 1:  # the HF config's TP plan, before any worker builds it
        from meshrun.models.hf_config import check_hf_tp_plan

        check_hf_tp_plan(cfg.model.hf, options.sequence_parallel)


def fixed_world_size(nproc_per_node: str, nnodes: str) -> int | None:
    """nproc_per_node x nnodes when both are fixed numbers; None for 'auto', cpu/gpu counts or
    an elastic MIN:MAX node range (the world is known only at launch)."""
    from meshrun.launch.args import fixed_nnodes

    nodes = fixed_nnodes(str(nnodes))
    nproc = str(nproc_per_node).strip()
    if not nproc.isdigit() or nodes is None:
        return None
    return int(nproc) * nodes
