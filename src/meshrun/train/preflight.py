"""Checks `meshrun train` runs before starting any worker, so bad input costs one line, not N tracebacks."""

from __future__ import annotations

from meshrun.config import JobConfig
from meshrun.data.tokenizer import load_tokenizer
from meshrun.errors import ConfigError
from meshrun.launch.args import resolve_nproc_per_node


def preflight(cfg: JobConfig, *, nproc_per_node: str) -> None:
    """Raise a one-line MeshrunError for what would otherwise fail on every rank."""
    resolve_nproc_per_node(str(nproc_per_node))  # 0 or garbage: a LaunchError naming the flag
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if cfg.data.path:
        from meshrun.data.loader import load_data_tokens

        load_data_tokens(cfg.data.path, tokenizer)  # missing or corrupt file: DataError
    if cfg.model.factory:
        from meshrun.models.factory import load_factory

        load_factory(cfg.model.factory)  # does it import? (the model is built on the workers)
    if cfg.parallel.strategy != "ddp":
        raise ConfigError(f"parallel.strategy={cfg.parallel.strategy!r} is not available yet; use 'ddp'")
