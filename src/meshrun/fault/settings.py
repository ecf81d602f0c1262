"""What the torchft mode needs, checked before launch without importing torch; the names its
processes share (environment variables and files)."""

from __future__ import annotations

import importlib.util

from meshrun.config import JobConfig
from meshrun.errors import ConfigError
from meshrun.extras import missing_extra_message

TORCHFT = "torchft"
# Set by the launcher (launch.py) for every worker of a replica group; torchft reads the last two.
GROUP_ENV = "REPLICA_GROUP_ID"
NUM_GROUPS_ENV = "NUM_REPLICA_GROUPS"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
RECORDS_ENV = "MESHRUN_TORCHFT_DIR"  # where the groups write their ledgers and events
RECORDS_DIR = "torchft"  # <run dir>/torchft/
GROUP_DIR = "replica-{group}"  # group g > 0 trains in <run dir>/replica-g; group 0 in the run dir


def is_torchft(cfg: JobConfig) -> bool:
    return cfg.fault.mode == TORCHFT


def check_fault(cfg: JobConfig, *, nnodes: str = "1") -> None:
    """One ConfigError line for a torchft job that cannot run as configured; exact mode passes."""
    if not is_torchft(cfg):
        return
    mode = "fault.mode = 'torchft'"
    from meshrun.parallel.rules import check_replica_groups

    check_replica_groups(mode, cfg.parallel.strategy, cfg.parallel.tp, cfg.parallel.pp)
    if cfg.train.dtype == "fp16":
        raise ConfigError(f"{mode} does not take train.dtype = 'fp16' (a group's skipped overflow steps "
                          "would not match its peers'); use 'bf16' or 'fp32', or fault.mode = 'exact'")
    if nnodes.split(":")[-1] != "1":
        raise ConfigError(f"{mode} runs its replica groups on one host for now, got --nnodes {nnodes}; "
                          "use --nnodes 1, or fault.mode = 'exact'")
    if importlib.util.find_spec(TORCHFT) is None:
        raise ConfigError(missing_extra_message(TORCHFT, mode))
