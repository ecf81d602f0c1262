"""Does a checkpoint fit the model being trained? Checked from DCP's metadata, before any load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint.manifest import CheckpointError


def saved_tensors(path: Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor in a DCP checkpoint: flattened key -> metadata (global size, dtype)."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same user problem
        raise CheckpointError(f"{path} has no readable DCP metadata ({type(exc).__name__}); "
                              "give a checkpoint directory such as RUN/checkpoints/step-00000010") from None
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def check_fits(path: Path, model_state: dict[str, torch.Tensor]) -> None:
    """Raise a one-line CheckpointError when the saved model's tensors differ from `model_state`'s."""
    saved = {k[len("model."):]: v for k, v in saved_tensors(path).items() if k.startswith("model.")}
    missing = sorted(set(model_state) - set(saved))
    if missing:
        raise CheckpointError(f"checkpoint {path} has no tensor {missing[0]!r} (and {len(missing) - 1} more) of "
                              "this model: it was saved from another model; resume with the model config it "
                              "was saved with, or start fresh with --resume never")
    for name, tensor in model_state.items():
        shape = tuple(saved[name].size)
        if shape != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint {path} holds {name} with shape {list(shape)}, but this model's is "
                                  f"{list(tensor.shape)}: it was saved from another model shape; resume with "
                                  "the model config it was saved with, or start fresh with --resume never")


def check_resume(resume: str, build_model: Callable[[], nn.Module]) -> None:
    """Before any worker starts: `checkpoint.resume` = PATH must be a valid checkpoint of this model's shape.

    `build_model()` builds the model to train; it runs on the meta device (shapes only, no memory)
    and only when `resume` names a checkpoint ('auto' and 'never' need no check).
    """
    if resume in ("auto", "never"):
        return
    path = Path(resume)
    if not mf.is_checkpoint(path):
        raise CheckpointError(f"--resume {resume}: not a meshrun checkpoint directory; give one such as "
                              "runs/NAME/checkpoints/step-00000010 (see `meshrun ckpt list runs/NAME`), "
                              "'auto' or 'never'")
    bad = mf.problem(path)
    if bad:
        raise CheckpointError(f"--resume {resume}: {bad}; pick another with `meshrun ckpt list`")
    with torch.device("meta"):
        model = build_model()
    check_fits(path, model.state_dict())
