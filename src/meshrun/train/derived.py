"""What the trainer derives from the config and the meta model before it builds the layout,
and the final weights it writes at the end; kept apart so `trainer.py` reads as the loop."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from meshrun.config import JobConfig
from meshrun.errors import ConfigError
from meshrun.parallel.layout import BuiltLayout
from meshrun.rundir.runs import FINAL_WEIGHTS as WEIGHTS_FILE  # the one name of model.pt
from meshrun.runtime.process import DistEnv

logger = logging.getLogger(__name__)


def resolved_seq_len(cfg: JobConfig, model: nn.Module) -> int:
    max_len = getattr(getattr(model, "args", None), "max_seq_len", None)
    if max_len is not None and cfg.data.seq_len > max_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len={max_len}; "
                          f"lower data.seq_len or set model.max_seq_len >= {cfg.data.seq_len}")
    return cfg.data.seq_len


def flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    args = getattr(model, "args", None)
    if args is None:
        return None
    from meshrun.models.llama import flops_per_token

    return flops_per_token(args, seq_len)


def layout_record(cfg: JobConfig, dp_size: int) -> dict:
    p = cfg.parallel
    return {"strategy": p.strategy, "dp": dp_size, "dp_shard": p.dp_shard, "cp": p.cp, "tp": p.tp, "pp": p.pp, "ep": p.ep}


def save_final_weights(layout: BuiltLayout, run_dir: Path, env: DistEnv, *, adapters_only: bool = False) -> Path | None:
    """Rank 0 saves the whole unwrapped model's state_dict once: plain torch loads it with weights_only.

    With FSDP/TP/PP the shards and stages are gathered first (collectives on every rank).
    `adapters_only` (LoRA): only the adapters are saved; the base is the run's config's (trained/lora.py).
    """
    state = layout.full_state_dict()
    if not env.is_main:
        return None
    if adapters_only:
        from meshrun.models.lora import is_adapter

        state = {k: v for k, v in state.items() if is_adapter(k)}
    path = run_dir / WEIGHTS_FILE
    tmp = path.with_suffix(".pt.tmp")
    try:
        torch.save(state, tmp)
    except BaseException as exc:  # a full, read-only or failing disk: one line, not a traceback
        from meshrun.checkpoint import write_fault as wf
        from meshrun.runtime.diskfault import disk_write_error

        failed = wf.write_failure(exc)
        if failed is None:
            raise
        tmp.unlink(missing_ok=True)
        needed = wf.state_bytes(state)
        raise disk_write_error(wf.with_errno(failed, run_dir, needed), tmp, what=f"the final weights {WEIGHTS_FILE}",
                               needed=needed, after="free space there, then re-run the same command: it resumes "
                               "from the last checkpoint and writes them") from None
    tmp.replace(path)  # atomic: a crash mid-write never leaves a half file under the real name
    logger.info("saved %s", path)
    return path
