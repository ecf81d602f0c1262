"""The step loop of `meshrun train`: build, train, evaluate, log, save once.

Reads top to bottom in the order the guide teaches: ① the runtime is initialised by the
caller, ② the model is built on the meta device, split and sharded by the layout, and only this
rank's share is materialised (`init_weights(seed)`, or `model.init_from`), ③ data with a
resumable distributed sampler, optimizers after the weights exist, the checkpoint to resume,
④ the loop, which steps and evaluates the built layout whatever the parallelism (train/step.py). Every
component gets only its own config section.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from meshrun.checkpoint import Checkpointer
from meshrun.checkpoint.export import check_init_from, load_consolidated, read_consolidated
from meshrun.checkpoint.state import TrainState
from meshrun.config import JobConfig, as_dict
from meshrun.data.loader import build_loaders
from meshrun.data.tokenizer import load_tokenizer
from meshrun.debug.heartbeat import SETUP_PHASE
from meshrun.metrics.logger import MetricsLogger
from meshrun.metrics.progress import ProgressBar
from meshrun.metrics.stragglers import StragglerWatch, TimedBatches
from meshrun.metrics.system import (
    StepTimer,
    device_peak_flops,
    mfu,
    peak_memory_bytes,
    peak_memory_kind,
)
from meshrun.models.factory import build_meta_model
from meshrun.parallel.compile import CompileClock
from meshrun.parallel.layout import BuiltLayout, build_layout, is_meta
from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout, torch_dtype
from meshrun.rundir.runs import write_finished
from meshrun.runtime.alloc import MemoryMarks
from meshrun.runtime.process import DistEnv, phase
from meshrun.train.derived import (
    flops_per_token,
    layout_record,
    resolved_seq_len,
    save_final_weights,
)
from meshrun.train.moe_stats import MoEStats
from meshrun.train.optimizers import build_optimizer
from meshrun.train.precision import build_loss_scaler
from meshrun.train.profile import StepProfiler, StepRange
from meshrun.train.schedules import build_scheduler
from meshrun.train.seed import seed_everything
from meshrun.train.step import layout_evaluate, layout_mean_loss, layout_step

logger = logging.getLogger(__name__)
COMPILE_STEPS = 2  # a compiled layout's first steps compile (announced to the hang watchdog)

class StepSource(Protocol):
    """Which steps the loop runs, and what ends each one. Exact mode: `ExactSteps`. torchft mode:
    meshrun.fault's Replica (quorum, heal, retry of an uncommitted step), which meshrun.fault.worker
    hands to `train` as its `steps` factory; the loop knows only this protocol.

    `steps` may end before `total`: the run's result is then another worker's (torchft: the other
    replica groups finished the run while this one was away), and `train` raises `EndedElsewhere`."""

    def steps(self, state: TrainState, total: int, metrics: MetricsLogger | None = None) -> Iterable[int]: ...

    def step_done(self, checkpointer: Checkpointer, state: TrainState) -> None: ...


class ExactSteps:
    """Exact mode: the steps are the trainer's range; the checkpointer ends each one."""

    def steps(self, state: TrainState, total: int, metrics: MetricsLogger | None = None) -> Iterable[int]:
        return range(state.step + 1, total + 1)

    def step_done(self, checkpointer: Checkpointer, state: TrainState) -> None:
        checkpointer.step_done(state)


class EndedElsewhere(Exception):  # noqa: N818 - a control-flow signal, not an error
    """The step source ended the loop at `step`, before the last: this worker writes no final
    weights and no finished.json (the run's result is another worker's) and exits 0."""

    def __init__(self, step: int, total: int):
        super().__init__(f"stopped at step {step} of {total}: the run was finished by its other replica groups")
        self.step, self.total = step, total


# Builds the step source once the layout and the resumed state exist (it may wrap both in place).
StepSourceFactory = Callable[[JobConfig, DistEnv, BuiltLayout, TrainState], StepSource]


@dataclass
class TrainResult:
    """What a finished run reports back (used by tests and the Python API)."""

    steps: int
    losses: list[tuple[int, float]]
    eval_losses: list[tuple[int, float]]
    weights_path: Path | None
    tokens_per_s: float | None


@dataclass
class _Run:
    """What the loop works on: built once by `_setup`."""

    layout: BuiltLayout
    state: TrainState
    checkpointer: Checkpointer
    val_loader: object | None
    seq_len: int
    num_params: int
    flops_per_token: float | None
    memory: MemoryMarks
    losses: list[tuple[int, float]] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    steps: StepSource = field(default_factory=ExactSteps)  # which steps run, and what ends each
    moe: MoEStats | None = None  # a mixture of experts: loads over the ranks, bias update (None: dense)


def train(cfg: JobConfig, env: DistEnv, run_dir: Path, profile: StepRange | None = None,
          steps: StepSourceFactory | None = None) -> TrainResult:
    """Train as `cfg` says on the current world; rank 0 writes metrics and the final weights.
    `steps`: the step source's factory (torchft mode's, from meshrun.fault.worker); None = exact."""
    with phase(SETUP_PHASE):  # the hang watchdog bounds the first steps by the setup's length
        run = _setup(cfg, env, run_dir)
    with run.checkpointer:  # its SIGTERM/SIGINT handlers are put back on every way out
        if steps is not None:  # torchft: wraps model and optimizer
            run.steps = steps(cfg, env, run.layout, run.state)
        return _loop(run, cfg, env, run_dir, StepProfiler(profile, run_dir, env.rank))


def _loop(run: _Run, cfg: JobConfig, env: DistEnv, run_dir: Path, profiler: StepProfiler) -> TrainResult:
    """④ step, log, evaluate and checkpoint until train.steps, then save the final weights."""
    tcfg = cfg.train
    layout, state = run.layout, run.state
    tokens_per_step = tcfg.batch_size * tcfg.grad_accum * run.seq_len * layout.dp_size
    metrics = MetricsLogger(run_dir, rank=env.rank, enabled_jsonl=cfg.metrics.jsonl,
                            tensorboard=cfg.metrics.tensorboard, trackers=cfg.metrics.tracker_names, config=as_dict(cfg))
    metrics.log_meta(world_size=env.world_size, device=str(env.device), backend=env.backend,
                     num_params=run.num_params, seq_len=run.seq_len, tokens_per_step=tokens_per_step,
                     batch_size=tcfg.batch_size, grad_accum=tcfg.grad_accum, dtype=tcfg.dtype, start_step=state.step)
    progress = ProgressBar(tcfg.steps, rank=env.rank, interval=tcfg.log_interval)
    progress.write(f"training {run.num_params / 1e6:.2f}M parameters on {env.world_size} x {env.device} "
                   f"({env.backend}), {tcfg.steps} steps of {tokens_per_step} tokens")
    if run.moe is not None:
        progress.write(run.moe.describe)
    timer = StepTimer(warmup_steps=2, sync=_sync_fn(env.device))
    clock = CompileClock(tcfg.compile, compiled=bool(layout.compiled))  # inductor compiles in the first calls
    if clock.active:
        progress.write(clock.notice())

    # ④ the loop
    layout.train()
    if state.step == 0:  # a resumed run has its step-0 eval already
        _evaluate(run, cfg, 0, metrics, progress)
    compiled_steps, compiled_kinds = 0, set()
    stragglers = StragglerWatch(env.world_size, env.device, enabled=layout.pipeline is None)
    for step in run.steps.steps(state, tcfg.steps, metrics):  # exact: range(state.step + 1, steps + 1)
        profiler.at(step)  # --profile: ends the previous step's span, starts this one's
        timer.start()
        log_now = step % cfg.metrics.interval == 0 or step == tcfg.steps
        # inductor compiles in a compiled layout's first calls, and again for the first step that logs
        # (it then also computes the grad norm): those are announced, so the hang watchdog waits them out
        compiling = layout.compiled and (compiled_steps < COMPILE_STEPS or log_now not in compiled_kinds)
        batches = TimedBatches(state.train_loader)
        with phase("compile") if compiling else nullcontext():
            loss, grad_norm, compute_s = layout_step(
                layout, state.optimizers, batches, grad_accum=tcfg.grad_accum, dtype=tcfg.dtype,
                sync_each_micro_batch=tcfg.sync_each_micro_batch, grad_clip=tcfg.grad_clip, need_grad_norm=log_now, scaler=state.scaler,
                masked=getattr(state.train_loader, "masked", False))
        moe_figures = run.moe.after_step(log_now, layout.device) if run.moe is not None else None
        compiled_steps += 1
        compiled_kinds.add(log_now)
        lr = state.schedulers[0].get_last_lr()[0]
        for scheduler in state.schedulers:
            scheduler.step()
        state.step = step
        timing = timer.stop(tokens_per_step)
        if run.memory.first_step is None:
            run.memory.mark_first_step()
            if clock.active:
                metrics.log_meta(**clock.record(timing.step_time_s))
        metrics.log_rank_step(step, step_time_s=timing.step_time_s, compute_time_s=compute_s,
                              data_time_s=batches.waited_s,
                              peak_mem_bytes=peak_memory_bytes(env.device) if step % cfg.metrics.interval == 0 else None)
        _name_stragglers(stragglers, step, batches.waited_s, compute_s, metrics, progress)
        _log_step(run, cfg, env, step, loss, grad_norm, lr, timing, metrics, progress, moe_figures)
        if tcfg.eval_interval and step % tcfg.eval_interval == 0 and step != tcfg.steps:
            _evaluate(run, cfg, step, metrics, progress)
        run.steps.step_done(run.checkpointer, state)  # checkpoint every interval steps (torchft: if committed)
    profiler.close()
    if state.step < tcfg.steps:  # the step source stopped: nothing of this worker's is the run's result
        run.checkpointer.finish(state, final_save=False)
        progress.close()
        metrics.close()
        raise EndedElsewhere(state.step, tcfg.steps)
    run.checkpointer.finish(state)
    _evaluate(run, cfg, tcfg.steps, metrics, progress)
    progress.close()
    run.memory.mark_trained()

    with phase("final weights"):
        weights = save_final_weights(layout, run_dir, env, adapters_only=cfg.lora.enabled)
    if env.is_main:  # after model.pt: the run is finished, and a restarted worker will not redo it
        write_finished(run_dir, tcfg.steps)
    run.memory.mark_end()
    metrics.log_meta(event="end", tokens_per_s=timer.mean_tokens_per_s,
                     peak_mem_bytes=peak_memory_bytes(env.device), **run.memory.gathered())
    metrics.close()
    return TrainResult(tcfg.steps, run.losses, run.eval_losses, weights, timer.mean_tokens_per_s)


def _setup(cfg: JobConfig, env: DistEnv, run_dir: Path) -> _Run:
    """② model, layout and weights, then ③ data, optimizers and the checkpoint to resume."""
    tcfg = cfg.train
    seed_everything(tcfg.seed)
    memory = MemoryMarks()  # the torch runtime, before anything of the model exists
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_meta_model(cfg.model, tokenizer.vocab_size, seed=tcfg.seed)
    if cfg.data.packing and hasattr(model, "check_packing"):  # model.hf: transformers must mask examples apart
        model.check_packing()
    meta = is_meta(model)
    if cfg.model.init_from:  # names and shapes, before any weight is allocated
        check_init_from(cfg.model.init_from, lambda built=model: built)
    if not meta:
        if cfg.model.init_from:  # a model built eagerly: its weights now, before it is moved
            load_consolidated(model, cfg.model.init_from)
        model = model.to(env.device)
    if cfg.lora.enabled:  # peft's LoRA layers, base frozen: before the layout shards anything
        from meshrun.models.lora import apply_run_lora

        model = apply_run_lora(model, cfg.lora, tcfg.dtype)
    seq_len = resolved_seq_len(cfg, model)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    num_params = sum(p.numel() for p in model.parameters())
    flops_tok = flops_per_token(model, seq_len)
    model_args = getattr(model, "args", None)
    resolved = resolve_layout(ParallelOptions.from_config(cfg), env.world_size, ModelShape.from_model(model))
    layout = build_layout(model, resolved, device=env.device, seed=tcfg.seed, compile=tcfg.compile)
    del model  # the layout holds this rank's parts now
    if meta and cfg.model.init_from:
        layout.load_full_state_dict(read_consolidated(cfg.model.init_from), lora=cfg.lora.enabled)
    if cfg.model.hf:  # this rank's shards straight from the safetensors (a resume overwrites them)
        from meshrun.models.hf_load import load_hf_weights

        load_hf_weights(layout.parts, cfg.model.hf)
    fingerprint = None
    if cfg.lora.enabled:  # the adapters start from the same values in every layout; the base is fixed now
        from meshrun.models.lora import base_fingerprint, init_adapters

        init_adapters(layout.parts, tcfg.seed)
        fingerprint = base_fingerprint(layout.parts)

    # ③ data: this data-parallel rank's disjoint share; the sampler reshuffles every epoch itself
    train_batches, val_loader, _ = build_loaders(
        cfg.data, seq_len=seq_len, batch_size=tcfg.batch_size, dp_rank=layout.dp_rank,
        dp_size=layout.dp_size, seed=tcfg.seed, tokenizer=tokenizer, vocab_size=vocab)
    # After materialisation and before any forward: FSDP2 swaps parameters in both.
    optimizers = [build_optimizer(part, cfg.optim) for part in layout.parts]
    schedulers = [build_scheduler(opt, cfg.optim, tcfg.steps) for opt in optimizers]
    scaler = build_loss_scaler(tcfg.dtype, layout.parts, env.device, init_scale=tcfg.loss_scale)
    state = TrainState(layout.parts, optimizers, schedulers, train_batches, scaler=scaler,
                       adapters_only=cfg.lora.enabled, base_fingerprint=fingerprint)
    checkpointer = Checkpointer(cfg.checkpoint, run_dir=run_dir, env=env,
                                layout=layout_record(cfg, layout.dp_size))
    try:
        checkpointer.resume(state)  # the latest valid checkpoint (checkpoint.resume), resharded to this layout
    except BaseException:
        checkpointer.close()
        raise
    memory.mark_startup()
    return _Run(layout, state, checkpointer, val_loader, seq_len, num_params, flops_tok, memory,
                moe=MoEStats.of(layout.parts, model_args, forwards_per_step=cfg.train.grad_accum * (
                    layout.pipeline.plan.microbatches if layout.pipeline is not None else 1),
                    device_type=env.device.type, dtype=torch_dtype(cfg.train.dtype)))


def _log_step(run: _Run, cfg: JobConfig, env: DistEnv, step: int, loss, grad_norm, lr, timing,
              metrics: MetricsLogger, progress: ProgressBar, moe_figures: dict | None = None) -> None:
    """The loss (a collective, so on the same steps on every rank), metrics.jsonl and the bar."""
    tcfg = cfg.train
    log_now = step % cfg.metrics.interval == 0 or step == tcfg.steps
    show_now = step % tcfg.log_interval == 0 or step == tcfg.steps
    if not (log_now or show_now):
        progress.update(step)
        return
    value = layout_mean_loss(run.layout, loss)
    run.losses.append((step, value))
    if log_now:
        peak = device_peak_flops(env.device, torch_dtype(tcfg.dtype))
        flops = mfu(run.flops_per_token, timing.tokens_per_s / env.world_size, peak)
        metrics.log_train(step, loss=value, lr=lr, grad_norm=float(grad_norm),
                          tokens_per_s=timing.tokens_per_s, step_time_s=timing.step_time_s,
                          peak_mem_bytes=peak_memory_bytes(env.device),
                          peak_mem_kind=peak_memory_kind(env.device), mfu=flops,
                          skipped_steps=run.state.scaler.skipped_steps if run.state.scaler else None,
                          **(moe_figures or {}))
    progress.update(step, loss=value, tokens_per_s=timing.tokens_per_s)


def _name_stragglers(watch: StragglerWatch, step: int, data_s: float, forward_s: float, metrics: MetricsLogger,
                     progress: ProgressBar) -> None:
    """Every WINDOW steps (a collective on every rank): name a rank that has become a straggler, or is no longer one."""
    new, gone = watch.add(data_s, forward_s)
    for found in new:
        progress.write(f"step {step}: straggler: {found.line()}")
        metrics.log_meta(event="straggler", step=step, rank=found.rank, ratio=round(found.ratio, 3),
                         own_s=found.own_s, others_s=found.others_s, data_share=round(found.data_share, 3))
    for rank in gone:
        progress.write(f"step {step}: rank {rank} is no longer a straggler")
        metrics.log_meta(event="straggler_cleared", step=step, rank=rank)


def _evaluate(run: _Run, cfg: JobConfig, step: int, metrics: MetricsLogger, progress: ProgressBar) -> None:
    if run.val_loader is None:
        return
    with phase("eval"):
        value = layout_evaluate(run.layout, run.val_loader, steps=cfg.train.eval_steps, dtype=cfg.train.dtype,
                                masked=getattr(run.state.train_loader, "masked", False))
    run.eval_losses.append((step, value))
    metrics.log_eval(step, eval_loss=value)
    progress.write(f"step {step}: eval loss {value:.4f}")


def _sync_fn(device: torch.device):
    if device.type == "cpu":
        return None
    return lambda: torch.accelerator.synchronize(device)
