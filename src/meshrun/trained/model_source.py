"""Where a trained model's weights are, one tensor at a time: a checkpoint of any layout, or a run.

    source = open_source(Path("runs/tiny"))                 # model.pt if finished, else latest checkpoint
    source = open_source(Path("runs/tiny/checkpoints/step-00000020"))
    for name in source.names: tensor = source.read(name)   # full tensors, meshrun's names, no "model."

A checkpoint is read through checkpoint/export.py (DCP metadata first, then each tensor assembled
from every rank's shards, no process group); model.pt through torch.load(weights_only=True, mmap=True).
The run's settings come from the checkpoint's own train_state.pt (the config it trained with), else
from RUN/config.toml, as plain TOML data: `ckpt export --format hf` and `meshrun generate` both use this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshrun.checkpoint import manifest as mf
from meshrun.errors import ConfigError
from meshrun.rundir.runs import CONFIG_FILE, FINAL_WEIGHTS, finished_step


@dataclass
class ModelSource:
    """A trained model's tensors, read on demand, and the run settings that describe them."""

    path: Path
    """What the user named: the checkpoint directory, or the run's model.pt."""
    config: dict
    """The run's config as TOML data ({"model": {...}, "data": {...}, ...})."""
    run_dir: Path | None
    """The run directory, when the weights sit in one (for relative paths and messages)."""
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """meshrun tensor name (without "model.") -> (shape, dtype), known before anything is read."""
    _read: Callable[[str], torch.Tensor] = field(repr=False)

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def nbytes(self, name: str) -> int:
        shape, dtype = self.specs[name]
        return int(torch.Size(shape).numel()) * dtype.itemsize

    def read(self, name: str) -> torch.Tensor:
        """One full tensor; the caller drops it when done, so at most a few are ever held."""
        return self._read(name)

    @property
    def hf_dir(self) -> str:
        """`[model] hf` of the run: the Hugging Face model directory it trained, or ''."""
        return str(self.config.get("model", {}).get("hf", "") or "")


def open_source(path: Path) -> ModelSource:
    """A run directory (model.pt if it finished, else its newest valid checkpoint) or a checkpoint directory."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a run directory (runs/NAME) or a checkpoint "
                          "(runs/NAME/checkpoints/step-N)")
    if mf.is_checkpoint(path):
        return from_checkpoint(path)
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        return from_run(path)
    raise ConfigError(f"{path} is neither a meshrun run directory (no {CONFIG_FILE}) nor a checkpoint "
                      f"(no {mf.MANIFEST}); give runs/NAME or runs/NAME/checkpoints/step-N")


def from_checkpoint(ckpt: Path) -> ModelSource:
    from meshrun.checkpoint.export import model_tensors, read_model_tensor

    metas = model_tensors(ckpt)  # checks the manifest and checksums before anything is parsed
    specs = {name: (tuple(md.size), md.properties.dtype) for name, md in metas.items()}
    config = _checkpoint_config(ckpt)
    run_dir = ckpt.parent.parent if ckpt.parent.name == mf.CHECKPOINTS else None
    return ModelSource(ckpt, config, run_dir, specs, lambda name: read_model_tensor(ckpt, name, metas[name]))


def from_run(run: Path) -> ModelSource:
    weights = run / FINAL_WEIGHTS
    if finished_step(run) is not None:
        try:
            state = torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - an unreadable file is the same user problem
            raise ConfigError(f"{weights} does not load as a state_dict ({type(exc).__name__}); give one of "
                              f"the run's checkpoints instead ({run}/{mf.CHECKPOINTS}/step-N)") from None
        if not isinstance(state, dict):
            raise ConfigError(f"{weights} holds a {type(state).__name__}, not a state_dict")
        specs = {k: (tuple(v.shape), v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor)}
        return ModelSource(weights, read_config(run / CONFIG_FILE), run, specs, lambda name: state[name])
    from meshrun.checkpoint.selection import latest_valid

    ckpt = latest_valid(mf.checkpoints_dir(run))
    if ckpt is None:
        raise ConfigError(f"{run} has neither final weights ({FINAL_WEIGHTS}) nor a valid checkpoint; "
                          "train it to the end, or with --set checkpoint.interval=N")
    return from_checkpoint(ckpt)


def read_config(path: Path) -> dict:
    """A run's config.toml as TOML data; one line when it is missing or malformed."""
    from meshrun.config.loader import read_toml

    return read_toml(path)


def _checkpoint_config(ckpt: Path) -> dict:
    """The config the checkpoint trained with (its train_state.pt), else its run's config.toml."""
    text = ""
    try:
        text = torch.load(ckpt / mf.TRAIN_STATE, weights_only=True).get("config", "") or ""
    except Exception:  # noqa: BLE001 - fall back to the run's config.toml below
        text = ""
    from meshrun.config import loader

    if text and loader.tomllib is not None:
        try:
            return loader.tomllib.loads(text)
        except ValueError:  # TOMLDecodeError is a ValueError; fall back to config.toml
            pass
    run_config = ckpt.parent.parent / CONFIG_FILE
    if ckpt.parent.name == mf.CHECKPOINTS and run_config.is_file():
        return read_config(run_config)
    raise ConfigError(f"{ckpt}: no config recorded in {mf.TRAIN_STATE} and no {CONFIG_FILE} in its run "
                      "directory; export a checkpoint that sits in its run (RUN/checkpoints/step-N)")
