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
    """Degrees vs world size, heads and layers, pipeline schedule vs stages and batch, before any
    process group exists."""
    pcfg = cfg.parallel
    if (pcfg.sequence_parallel or pcfg.loss_parallel) and pcfg.tp == 1:
        raise ConfigError("parallel.sequence_parallel / parallel.loss_parallel split over tensor-parallel "
                          "ranks; set parallel.tp > 1 (with parallel.strategy = 'fsdp') or turn them off")
    if (pcfg.sequence_parallel or pcfg.loss_parallel) and pcfg.pp > 1:
        raise ConfigError("parallel.sequence_parallel / parallel.loss_parallel do not compose with "
                          "parallel.pp > 1 here; turn them off or set parallel.pp=1")
    nproc = resolve_nproc_per_node(str(nproc_per_node))
    nodes = _fixed_nnodes(str(nnodes))
    if not nproc.isdigit() or nodes is None:
        return  # cpu/gpu counts or an elastic MIN:MAX world: checked on the workers
    dims = ParallelDims.from_config(pcfg, world_size=int(nproc) * nodes)
    if cfg.model.factory:
        return  # the user's model: its layout is checked on the workers
    args = model_args_from_config(cfg.model, vocab_size)
    dims.check_model_args(args)
    if dims.pp_enabled:
        from meshrun.parallel.pipeline import plan_pipeline

        plan_pipeline(pp=dims.pp, schedule=pcfg.pp_schedule, stages_per_rank=pcfg.pp_stages_per_rank,
                      split_points=pcfg.pp_split_points, n_layers=args.n_layers,
                      batch_size=cfg.train.batch_size, microbatches=pcfg.pp_microbatches,
                      dp_size=dims.dp_size)
        if args.tie_embeddings:
            raise ConfigError("pipeline parallel with model.tie_embeddings=true would split the shared "
                              "matrix between the first and last stage; set model.tie_embeddings=false")


def _fixed_nnodes(nnodes: str) -> int | None:
    """N, or N:N (the launcher may spell a fixed node count as a range); None for MIN:MAX."""
    low, _, high = nnodes.partition(":")
    if low.isdigit() and (not high or high == low):
        return int(low)
    return None
