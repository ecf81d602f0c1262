"""The step loop of `meshrun train`: build, train, evaluate, log, save once.

Reads top to bottom in the order the guide teaches: ① the runtime is initialised by the
caller, ② model -> device -> parallelize, ③ data with a resumable distributed sampler,
④ the loop. Every component gets only its own config section.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from meshrun.checkpoint import Checkpointer
from meshrun.config import JobConfig
from meshrun.data.loader import build_loaders
from meshrun.data.tokenizer import load_tokenizer
from meshrun.errors import ConfigError
from meshrun.metrics.logger import MetricsLogger
from meshrun.metrics.progress import ProgressBar
from meshrun.metrics.system import (
    StepTimer,
    device_peak_flops,
    mfu,
    peak_memory_bytes,
    peak_memory_kind,
)
from meshrun.models.factory import build_model
from meshrun.parallel.layout import Layout, build_layout
from meshrun.runtime.session import DistEnv
from meshrun.train.optim import build_optimizer, build_scheduler
from meshrun.train.seed import seed_everything
from meshrun.train.state import TrainState
from meshrun.train.step import (
    DTYPES,
    evaluate,
    evaluate_pp,
    mean_loss_across_ranks,
    train_step,
    train_step_pp,
)

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.pt"


@dataclass
class TrainResult:
    """What a finished run reports back (used by tests and the Python API)."""

    steps: int
    losses: list[tuple[int, float]]
    eval_losses: list[tuple[int, float]]
    weights_path: Path | None
    tokens_per_s: float | None


def _resolved_seq_len(cfg: JobConfig, model: nn.Module) -> int:
    max_len = getattr(getattr(model, "args", None), "max_seq_len", None)
    if max_len is not None and cfg.data.seq_len > max_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len={max_len}; "
                          f"lower data.seq_len or set model.max_seq_len >= {cfg.data.seq_len}")
    return cfg.data.seq_len


def _flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    args = getattr(model, "args", None)
    if args is None:
        return None
    from meshrun.models.llama import flops_per_token

    return flops_per_token(args, seq_len)


def train(cfg: JobConfig, env: DistEnv, run_dir: Path) -> TrainResult:
    """Train as `cfg` says on the current world; rank 0 writes metrics and the final weights."""
    tcfg = cfg.train
    seed_everything(tcfg.seed)
    tokenizer = load_tokenizer(cfg.data.tokenizer)

    # ② the model: built (seeded, the same on every rank), moved, then wrapped for the world
    model = build_model(cfg.model, tokenizer.vocab_size, seed=tcfg.seed).to(env.device)
    seq_len = _resolved_seq_len(cfg, model)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    num_params = sum(p.numel() for p in model.parameters())
    flops_tok = _flops_per_token(model, seq_len)
    layout = build_layout(model, cfg.parallel, device=env.device, world_size=env.world_size, train_cfg=tcfg)
    dp_rank, dp_size, pipeline = layout.dp_rank, layout.dp_size, layout.pipeline

    # ③ data: this data-parallel rank's disjoint share; the sampler reshuffles every epoch itself
    train_batches, val_loader, _ = build_loaders(
        cfg.data, seq_len=seq_len, batch_size=tcfg.batch_size, dp_rank=dp_rank,
        dp_size=dp_size, seed=tcfg.seed, tokenizer=tokenizer, vocab_size=vocab)
    model_parts = layout.parts  # one part per pipeline stage held by this rank; one without PP
    model = model_parts[0]
    optimizers = [build_optimizer(part, cfg.optim) for part in model_parts]
    schedulers = [build_scheduler(opt, cfg.optim, tcfg.steps) for opt in optimizers]
    state = TrainState(model_parts, optimizers, schedulers, train_batches)
    checkpointer = Checkpointer(cfg.checkpoint, run_dir=run_dir, env=env, layout=_layout_record(cfg, dp_size))
    checkpointer.resume(state)  # the latest valid checkpoint (checkpoint.resume), resharded to this layout

    tokens_per_step = tcfg.batch_size * tcfg.grad_accum * seq_len * dp_size
    peak = device_peak_flops(env.device, DTYPES[tcfg.dtype])
    metrics = MetricsLogger(run_dir, rank=env.rank, enabled_jsonl=cfg.metrics.jsonl,
                            tensorboard=cfg.metrics.tensorboard)
    metrics.log_meta(world_size=env.world_size, device=str(env.device), backend=env.backend,
                     num_params=num_params, seq_len=seq_len, tokens_per_step=tokens_per_step,
                     batch_size=tcfg.batch_size, grad_accum=tcfg.grad_accum, dtype=tcfg.dtype)
    progress = ProgressBar(tcfg.steps, rank=env.rank, interval=tcfg.log_interval)
    progress.write(f"training {num_params / 1e6:.2f}M parameters on {env.world_size} x {env.device} "
                   f"({env.backend}), {tcfg.steps} steps of {tokens_per_step} tokens")
    timer = StepTimer(warmup_steps=2, sync=_sync_fn(env.device))
    losses: list[tuple[int, float]] = []
    eval_losses: list[tuple[int, float]] = []

    def run_eval(step: int) -> None:
        if val_loader is None:
            return
        if pipeline is not None:
            local = evaluate_pp(pipeline, val_loader, steps=tcfg.eval_steps, device=env.device, dtype=tcfg.dtype)
        else:
            local = evaluate(model, val_loader, steps=tcfg.eval_steps, device=env.device, dtype=tcfg.dtype,
                             loss_parallel=layout.loss_parallel)
        value = mean_loss_across_ranks(local, env.world_size, layout.pp)
        eval_losses.append((step, value))
        metrics.log_eval(step, eval_loss=value)
        progress.write(f"step {step}: eval loss {value:.4f}")

    # ④ the loop
    for part in model_parts:
        part.train()
    if state.step == 0:  # a resumed run has its step-0 eval already
        run_eval(0)
    for step in range(state.step + 1, tcfg.steps + 1):
        timer.start()
        log_now = step % cfg.metrics.interval == 0 or step == tcfg.steps
        if pipeline is not None:
            loss, grad_norm, compute_s = train_step_pp(
                pipeline, optimizers, train_batches, grad_accum=tcfg.grad_accum, device=env.device,
                dtype=tcfg.dtype, grad_clip=tcfg.grad_clip, pp_group=layout.pp_group,
                need_grad_norm=log_now)
        else:
            loss, grad_norm, compute_s = train_step(
                model, optimizers[0], train_batches, grad_accum=tcfg.grad_accum, device=env.device,
                dtype=tcfg.dtype, grad_clip=tcfg.grad_clip, loss_parallel=layout.loss_parallel,
                need_grad_norm=log_now)
        lr = schedulers[0].get_last_lr()[0]
        for scheduler in schedulers:
            scheduler.step()
        state.step = step
        timing = timer.stop(tokens_per_step)
        metrics.log_rank_step(step, step_time_s=timing.step_time_s, compute_time_s=compute_s,
                              peak_mem_bytes=peak_memory_bytes(env.device) if step % cfg.metrics.interval == 0 else None)
        show_now = step % tcfg.log_interval == 0 or step == tcfg.steps
        if log_now or show_now:
            value = mean_loss_across_ranks(loss, env.world_size, layout.pp)  # a collective: every rank, same steps
            losses.append((step, value))
            if log_now:
                metrics.log_train(step, loss=value, lr=lr, grad_norm=float(grad_norm),
                                  tokens_per_s=timing.tokens_per_s, step_time_s=timing.step_time_s,
                                  peak_mem_bytes=peak_memory_bytes(env.device),
                                  peak_mem_kind=peak_memory_kind(env.device),
                                  mfu=mfu(flops_tok, timing.tokens_per_s / env.world_size, peak))
            progress.update(step, loss=value, tokens_per_s=timing.tokens_per_s)
        else:
            progress.update(step)
        if tcfg.eval_interval and step % tcfg.eval_interval == 0 and step != tcfg.steps:
            run_eval(step)
        checkpointer.step_done(state)  # every checkpoint.interval steps; SIGTERM: save, raise Preempted
    checkpointer.finish(state)
    run_eval(tcfg.steps)
    progress.close()

    weights = _save_final_weights(layout, run_dir, env)
    metrics.log_meta(event="end", tokens_per_s=timer.mean_tokens_per_s,
                     peak_mem_bytes=peak_memory_bytes(env.device))
    metrics.close()
    return TrainResult(tcfg.steps, losses, eval_losses, weights, timer.mean_tokens_per_s)


def _layout_record(cfg: JobConfig, dp_size: int) -> dict:
    p = cfg.parallel
    return {"strategy": p.strategy, "dp": dp_size, "dp_shard": p.dp_shard, "tp": p.tp, "pp": p.pp}


def _sync_fn(device: torch.device):
    if device.type == "cpu":
        return None
    return lambda: torch.accelerator.synchronize(device)


def _save_final_weights(layout: Layout, run_dir: Path, env: DistEnv) -> Path | None:
    """Rank 0 saves the whole unwrapped model's state_dict once: plain torch loads it with weights_only.

    With FSDP/TP/PP the shards and stages are gathered first (collectives on every rank).
    """
    state = layout.full_state_dict()
    if not env.is_main:
        return None
    path = run_dir / WEIGHTS_FILE
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a crash mid-write never leaves a half file under the real name
    logger.info("saved %s", path)
    return path
