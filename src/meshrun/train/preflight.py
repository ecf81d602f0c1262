"""Checks `meshrun train` runs before starting any worker, so bad input costs one line, not N tracebacks."""

from __future__ import annotations

from meshrun.config import JobConfig
from meshrun.data.tokenizer import load_tokenizer
from meshrun.errors import ConfigError
from meshrun.launch.args import resolve_nproc_per_node
from meshrun.models.factory import model_args_from_config
from meshrun.parallel.dims import ParallelDims


def preflight(cfg: JobConfig, *, nproc_per_node: str, nnodes: str = "1") -> None:
    """Raise a one-line MeshrunError for what would otherwise fail on every rank."""
    resolve_nproc_per_node(str(nproc_per_node))  # 0 or garbage: a LaunchError naming the flag
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if cfg.data.path:
        from meshrun.data.loader import load_data_tokens

        load_data_tokens(cfg.data.path, tokenizer)  # missing or corrupt file: DataError
    if cfg.model.factory:
        from meshrun.models.factory import load_factory

        load_factory(cfg.model.factory)  # does it import? (the model is built on the workers)
    _check_layout(cfg, tokenizer.vocab_size, nproc_per_node, nnodes)


def _check_layout(cfg: JobConfig, vocab_size: int, nproc_per_node: str, nnodes: str) -> None:
    """Degrees vs world size, heads and layers, before any process group exists."""
    if cfg.parallel.pp > 1:
        raise ConfigError(f"parallel.pp={cfg.parallel.pp}: pipeline parallel is not wired into "
                          "meshrun train yet; use parallel.pp=1 (examples/guide/pp_gpipe.py shows PP by hand)")
    nproc = resolve_nproc_per_node(str(nproc_per_node))
    if not nproc.isdigit() or not str(nnodes).isdigit():
        return  # cpu/gpu counts or an elastic MIN:MAX world: checked on the workers
    dims = ParallelDims.from_config(cfg.parallel, world_size=int(nproc) * int(nnodes))
    if not cfg.model.factory:
        dims.check_model_args(model_args_from_config(cfg.model, vocab_size))
