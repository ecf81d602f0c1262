"""Inspect a checkpoint, export its model as one consolidated file, and load such a file into a model.

    meshrun ckpt export runs/x/checkpoints/step-00000100 --format safetensors model.safetensors

Export needs no process group: it reads DCP's metadata, then one tensor at a time through
`dcp.load(..., no_dist=True)`, so each saved shard layout is assembled into plain full tensors
and the model is held once (the output dict), never twice. Only `model.*` is exported.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint.verify import saved_tensors
from meshrun.errors import ConfigError, ModelError

FORMATS = ("safetensors", "torch")


def inspect(ckpt: Path, *, checksums: bool = True) -> dict:
    """step, layout, validity and every tensor (name, shape, dtype, bytes) of one checkpoint."""
    ckpt = Path(ckpt)
    if not mf.is_checkpoint(ckpt):
        raise mf.CheckpointError(f"{ckpt} is not a meshrun checkpoint (no {mf.MANIFEST} or DCP .metadata); "
                                 "give a directory such as RUN/checkpoints/step-00000010")
    bad = mf.problem(ckpt, checksums=checksums)
    info: dict = {"path": str(ckpt), "valid": bad is None, "problem": bad, "step": None, "layout": {}}
    try:
        saved = torch.load(ckpt / mf.TRAIN_STATE, weights_only=True)
        info.update(step=saved["step"], layout=saved["layout"], data=saved["data"])
    except Exception as exc:  # noqa: BLE001 - a damaged file is reported, not raised
        info["problem"] = info["problem"] or f"{ckpt / mf.TRAIN_STATE} is unreadable ({type(exc).__name__})"
    tensors = []
    try:
        for key, md in sorted(saved_tensors(ckpt).items()):
            numel = 1
            for d in md.size:
                numel *= d
            dtype = md.properties.dtype
            tensors.append({"name": key, "shape": list(md.size), "dtype": str(dtype).replace("torch.", ""),
                            "bytes": numel * dtype.itemsize})
    except mf.CheckpointError as exc:
        info["problem"] = info["problem"] or str(exc)
    info["tensors"] = tensors
    return info


def export(ckpt: Path, out: Path, *, fmt: str = "safetensors") -> dict[str, tuple[int, ...]]:
    """Write the checkpoint's model as one file that plain torch/safetensors loads into the unwrapped model."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    save_file = _safetensors("save_file") if fmt == "safetensors" else None
    ckpt = Path(ckpt)
    if not mf.is_checkpoint(ckpt):
        raise mf.CheckpointError(f"{ckpt} is not a meshrun checkpoint; give RUN/checkpoints/step-N")
    bad = mf.problem(ckpt)
    if bad:
        raise mf.CheckpointError(f"will not export a damaged checkpoint: {bad}")
    state: dict[str, torch.Tensor] = {}
    for key, md in saved_tensors(ckpt).items():
        if not key.startswith("model."):
            continue
        tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": {key[len("model."):]: tensor}}, checkpoint_id=str(ckpt), no_dist=True)
        state[key[len("model."):]] = tensor
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if save_file is not None:
        save_file(state, str(tmp), metadata={"format": "pt", "source": str(ckpt)})
    else:
        torch.save(state, tmp)
    tmp.replace(out)
    return {k: tuple(v.shape) for k, v in state.items()}


def read_consolidated(path: str | Path) -> dict[str, torch.Tensor]:
    """A consolidated state_dict from a .safetensors file or a torch.save'd dict."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"model.init_from={str(path)!r} does not exist; give a file from "
                         "`meshrun ckpt export` (.safetensors or torch) or a torch state_dict file")
    if path.suffix == ".safetensors":
        return _safetensors("load_file")(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user problem
        raise ModelError(f"model.init_from={str(path)!r} is not a torch state_dict file "
                         f"({type(exc).__name__}); export one with `meshrun ckpt export`") from None
    if not isinstance(state, dict):
        raise ModelError(f"model.init_from={str(path)!r} holds a {type(state).__name__}, not a state_dict")
    return state


def load_consolidated(model: nn.Module, path: str | Path) -> None:
    """Copy a consolidated file's weights into `model`; a name or shape mismatch is one clear line."""
    state = read_consolidated(path)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ModelError(f"model.init_from={str(path)!r} has no weight {missing[0]!r} (and {len(missing) - 1} "
                         "more): it was saved from another model")
    for name, tensor in own.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ModelError(f"model.init_from={str(path)!r}: {name} has shape {list(state[name].shape)}, "
                             f"this model's is {list(tensor.shape)}; use the model config it was saved with")
    model.load_state_dict({k: state[k] for k in own})


def _safetensors(name: str):
    try:
        import safetensors.torch as st
    except ImportError:
        raise ConfigError("the safetensors format needs the safetensors package: pip install safetensors "
                          "(or use --format torch)") from None
    return getattr(st, name)
