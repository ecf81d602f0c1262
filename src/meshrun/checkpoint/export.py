"""Inspect a checkpoint, export its model as one consolidated file, and load such a file into a model.

    meshrun ckpt export runs/x/checkpoints/step-00000100 --format safetensors model.safetensors

Export needs no process group: it reads DCP's metadata, then one tensor at a time through
`dcp.load(..., no_dist=True)` (through safe_load.py's readers), so each saved shard layout is assembled into plain full tensors
and the model is held once (the output dict), never twice. Only `model.*` is exported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint import safe_load
from meshrun.checkpoint.verify import differences, saved_tensors
from meshrun.errors import ConfigError, ModelError
from meshrun.runtime.files import follow_umask

FORMATS = ("safetensors", "torch")


def inspect(ckpt: Path, *, checksums: bool = True) -> dict:
    """step, layout, validity and every tensor (name, shape, dtype, bytes) of one checkpoint."""
    ckpt = Path(ckpt)
    if not mf.is_checkpoint(ckpt):
        raise mf.CheckpointError(f"{ckpt} is not a meshrun checkpoint (no {mf.MANIFEST} or DCP .metadata); "
                                 "give a directory such as RUN/checkpoints/step-00000010")
    bad = mf.problem(ckpt, checksums=checksums)
    info: dict = {"path": str(ckpt), "valid": bad is None, "problem": bad, "step": None, "layout": {},
                  "tensors": []}
    if bad is not None:  # nothing of a damaged checkpoint is unpickled, not even through safe readers
        try:
            info.update(step=mf.read_manifest(ckpt)["step"], layout=mf.read_manifest(ckpt).get("layout", {}))
        except mf.CheckpointError:
            pass
        return info
    tensors = []
    try:
        saved = torch.load(ckpt / mf.TRAIN_STATE, weights_only=True)
        info.update(step=saved["step"], layout=saved["layout"], data=saved["data"])
        for key, md in sorted(saved_tensors(ckpt).items()):
            numel = 1
            for d in md.size:
                numel *= d
            dtype = md.properties.dtype
            tensors.append({"name": key, "shape": list(md.size), "dtype": str(dtype).replace("torch.", ""),
                            "bytes": numel * dtype.itemsize})
    except Exception as exc:  # noqa: BLE001 - a file that passed its checksum but does not parse is reported
        info.update(valid=False, problem=f"{ckpt} does not parse as a meshrun checkpoint ({type(exc).__name__}: "
                                         f"{exc})")
    info["tensors"] = tensors
    return info


def export(ckpt: Path, out: Path, *, fmt: str = "safetensors") -> dict[str, tuple[int, ...]]:
    """Write the checkpoint's model as one file that plain torch/safetensors loads into the unwrapped model."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    save_file = _safetensors("save_file") if fmt == "safetensors" else None
    state = {name: read_model_tensor(ckpt, name, md) for name, md in model_tensors(ckpt).items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if save_file is not None:
        save_file(state, str(tmp), metadata={"format": "pt", "source": str(ckpt)})
    else:
        torch.save(state, tmp)
    follow_umask(tmp)  # safetensors creates 0600; an export is as readable as torch.save's files
    tmp.replace(out)
    return {k: tuple(v.shape) for k, v in state.items()}


def model_tensors(ckpt: Path) -> dict:
    """The checkpoint's model tensors (name without `model.` -> DCP metadata), checked, nothing read yet."""
    ckpt = Path(ckpt)
    if not mf.is_checkpoint(ckpt):
        raise mf.CheckpointError(f"{ckpt} is not a meshrun checkpoint; give RUN/checkpoints/step-N")
    bad = mf.problem(ckpt)
    if bad:
        raise mf.CheckpointError(f"will not export a damaged checkpoint: {bad}")
    return {key[len("model."):]: md for key, md in saved_tensors(ckpt).items() if key.startswith("model.")}


def read_model_tensor(ckpt: Path, name: str, md) -> torch.Tensor:
    """One model tensor, assembled from every rank's shards into a plain full tensor (no process group)."""
    tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    try:
        safe_load.load({"model": {name: tensor}}, Path(ckpt), no_dist=True)
    except Exception as exc:  # noqa: BLE001 - data that passed its checksums yet does not load
        raise mf.CheckpointError(f"{ckpt}: the tensor model.{name} does not load as its metadata describes it "
                                 f"(shape {list(md.size)}; {type(exc).__name__}: {exc})") from None
    return tensor


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


def consolidated_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a consolidated file, without reading its weights into memory."""
    path = Path(path)
    if path.suffix == ".safetensors" and path.is_file():
        safe_open = _safetensors("safe_open")
        try:
            with safe_open(str(path), framework="pt") as fh:
                return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118
        except Exception as exc:  # noqa: BLE001 - a damaged header is the same user problem
            raise ModelError(f"model.init_from={str(path)!r} is not a readable safetensors file "
                             f"({type(exc).__name__}); export one with `meshrun ckpt export`") from None
    if path.is_file() and path.suffix != ".safetensors":
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - not a zip-format file: read_consolidated says what it is
            state = None
        if isinstance(state, dict):
            return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    return {k: tuple(v.shape) for k, v in read_consolidated(path).items()}


def check_consolidated_fits(path: str | Path, shapes: dict[str, tuple[int, ...]], model: nn.Module) -> None:
    """One clear line when a consolidated file's tensors differ from `model`'s in name or shape."""
    diff = differences(shapes, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    if diff:
        raise ModelError(f"model.init_from={str(path)!r} does not fit this model: {diff}; "
                         "use the model config it was saved with")


def load_consolidated(model: nn.Module, path: str | Path) -> None:
    """Copy a consolidated file's weights into `model`; a name or shape mismatch is one clear line."""
    state = read_consolidated(path)
    check_consolidated_fits(path, {k: tuple(v.shape) for k, v in state.items()}, model)
    model.load_state_dict({k: state[k] for k in model.state_dict()})


def _safetensors(name: str):
    from meshrun.extras import import_extra

    return getattr(import_extra("safetensors.torch", "--format safetensors (or use --format torch)",
                                error=ConfigError), name)


def check_init_from(init_from: str, build_model: Callable[[], nn.Module]) -> None:
    """`model.init_from` must exist and fit this model's names and shapes: before any worker
    starts (train/preflight.py), and on the workers against the meta-built model.

    Reads the file's header (safetensors) or memory-maps it (torch), and builds the model on the
    meta device (a model already there is returned as it is), so the check costs no weight memory.
    """
    if not init_from:
        return
    shapes = consolidated_shapes(init_from)
    with torch.device("meta"):
        model = build_model()
    check_consolidated_fits(init_from, shapes, model)
