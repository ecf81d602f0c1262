"""Does a checkpoint fit the model being trained? Checked from DCP's metadata, before any load."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint.manifest import CheckpointError
from meshrun.checkpoint.safe_load import read_metadata
from meshrun.errors import shown

_FIX = ("resume with the model config it was saved with, or start fresh with --resume never "
        "(and --force, to set aside the checkpoints of a run that has some)")


def saved_tensors(path: Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor in a DCP checkpoint: flattened key -> metadata (global size, dtype).

    Read through the restricted unpickler (safe_load.py); call it only once the manifest checks pass.
    """
    metadata = read_metadata(path)
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _shape(value) -> tuple[int, ...]:
    return tuple(value.shape if hasattr(value, "shape") else value)


def differences(saved: Mapping[str, tuple], own: Mapping[str, tuple], *, limit: int = 3) -> str | None:
    """None when both map the same names to the same shapes, else the first few differences in one line."""
    groups = [("missing from the checkpoint", sorted(set(own) - set(saved))),
              ("not in this model", sorted(set(saved) - set(own))),
              ("of another shape", [f"{name} {list(saved[name])} saved, {list(own[name])} here"
                                    for name in sorted(set(own) & set(saved))
                                    if tuple(saved[name]) != tuple(own[name])])]
    total, parts, shown = sum(len(names) for _, names in groups), [], 0
    for what, names in groups:
        if names and shown < limit:
            parts.append(f"{what}: {', '.join(names[:limit - shown])}")
            shown += len(names[:limit - shown])
    if not total:
        return None
    return "; ".join(parts) + (f" (and {total - shown} more)" if total > shown else "")


def check_fits(path: Path, model_state: Mapping[str, torch.Tensor | tuple[int, ...]]) -> None:
    """Raise a one-line CheckpointError when the saved model's tensor names or shapes differ.

    `model_state` is the whole model's: name -> tensor (or shape). A checkpoint with more tensors
    than the model (e.g. 4 layers for a 2-layer model) does not fit either.
    """
    saved = {k[len("model."):]: tuple(v.size) for k, v in saved_tensors(path).items() if k.startswith("model.")}
    diff = differences(saved, {k: _shape(v) for k, v in model_state.items()})
    if diff:
        raise CheckpointError(f"checkpoint {path} does not fit this model: {diff}; {_FIX}")


def check_resume(resume: str, build_model: Callable[[], nn.Module], *, adapters_only: bool = False) -> None:
    """Before any worker starts: `checkpoint.resume` = PATH must be a valid checkpoint of this model's shape.

    `build_model()` builds the model to train; it runs on the meta device (shapes only, no memory)
    and only when `resume` names a checkpoint ('auto' and 'never' need no check).
    `adapters_only` (LoRA, models/lora.py): the checkpoint holds the trainable parameters only.
    """
    if resume in ("auto", "never"):
        return
    path = Path(resume)
    if not mf.is_checkpoint(path):
        refused = mf.unusable(path)
        if refused:  # one line, with the value cut: it may be thousands of characters
            raise CheckpointError(f"--resume (checkpoint.resume) {shown(resume)}: "
                                  f"not a usable path ({refused}); give a checkpoint directory, 'auto' or 'never'")
        raise CheckpointError(f"--resume {resume}: not a meshrun checkpoint directory; give one such as "
                              "runs/NAME/checkpoints/step-00000010 (see `meshrun ckpt list runs/NAME`), "
                              "'auto' or 'never'")
    bad = mf.problem(path)
    if bad:
        raise CheckpointError(f"--resume {resume}: {bad}; pick another with `meshrun ckpt list`")
    with torch.device("meta"):
        model = build_model()
    state = model.state_dict()
    params = dict(model.named_parameters())
    if adapters_only:
        state = {name: t for name, t in state.items() if name in params and params[name].requires_grad}
    check_fits(path, state)
