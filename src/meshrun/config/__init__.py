"""Typed config for `meshrun train`: dataclass sections, TOML, `--set` overrides, validation.

    from meshrun.config import load_config
    cfg = load_config("examples/configs/tiny.toml", ["optim.lr=3e-4"])
    build_model(cfg.model, vocab_size)      # a component gets only its own section

The `[parallel]` rules are `meshrun.parallel.resolve`'s (`check_options` here; the whole layout,
with the world size, in `resolve_layout`).

Sections are frozen; derive a changed one with `dataclasses.replace(cfg.train, steps=10)`.
"""

from __future__ import annotations

from meshrun.config.dump import CONFIG_FILE, as_dict, describe, save_config, to_toml
from meshrun.config.loader import (
    all_keys,
    apply_overrides,
    config_from_dict,
    load_config,
    parse_override,
    read_toml,
    set_flag,
    set_hint,
    suggest_key,
)
from meshrun.config.sections import (
    SECTIONS,
    CheckpointSection,
    DataSection,
    JobConfig,
    LaunchSection,
    MetricsSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    TrainSection,
)

__all__ = [
    "CONFIG_FILE",
    "SECTIONS",
    "CheckpointSection",
    "DataSection",
    "JobConfig",
    "LaunchSection",
    "MetricsSection",
    "ModelSection",
    "OptimSection",
    "ParallelSection",
    "TrainSection",
    "all_keys",
    "apply_overrides",
    "as_dict",
    "config_from_dict",
    "describe",
    "load_config",
    "parse_override",
    "read_toml",
    "save_config",
    "set_flag",
    "set_hint",
    "suggest_key",
    "to_toml",
]
