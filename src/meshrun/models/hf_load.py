"""Load a Hugging Face directory's safetensors straight into this rank's shards.

    layout = build_layout(meta_model, resolved, device=..., seed=...)   # this rank's shards, materialised
    load_hf_weights(layout.parts, cfg.model.hf)

`torch.distributed.checkpoint.load` with `HuggingFaceStorageReader` over the parts' own state
dict (`get_model_state_dict`: FSDP/TP parameters as DTensors, a pipeline stage only its names),
keys renamed to HF's (`models.hf_keys.to_hf_key`). The values are the parameters' tensors, so DCP
fills them in place and each rank reads only the slices it holds: never a full copy per rank
(https://docs.pytorch.org/docs/stable/distributed.checkpoint.html). Every rank calls it once
(DCP plans the reads collectively); without a process group it reads on one process.
"""

from __future__ import annotations

import logging

from torch import nn

from meshrun.errors import ModelError
from meshrun.models.hf_keys import to_hf_key

logger = logging.getLogger(__name__)


def hf_state_dict(parts: list[nn.Module]) -> dict:
    """The parts' parameters keyed by HF checkpoint names; a tied output projection is left out
    (it is the embedding's tensor, and HF checkpoints do not store `lm_head.weight` then)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state: dict = {}
    for part in parts:
        inner = getattr(part, "module", part)  # DDP
        tied = (getattr(inner, "output", None) is not None and getattr(inner, "tok_embeddings", None) is not None
                and inner.output.weight is inner.tok_embeddings.weight)
        for name, tensor in get_model_state_dict(part).items():
            if tied and name == "output.weight":
                continue
            state[to_hf_key(name)] = tensor
    return state


def load_hf_weights(parts: list[nn.Module], path: str) -> None:
    """Fill `parts` (this rank's materialised share of an `HFCausalLM`) from the safetensors in
    `path`; one ModelError line when the files do not hold what the model needs."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = hf_state_dict(parts)
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": one process is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps per-rank failures (a BaseException)
        text = " ".join(str(exc).split())
        raise ModelError(f"model.hf={path!r}: cannot load its safetensors into the model "
                         f"({type(exc).__name__}: {text[:300]})") from exc
    for part in parts:
        inner = getattr(part, "module", part)
        if hasattr(inner, "weights_pending"):
            inner.weights_pending = False
    logger.info("loaded %d tensors from %s", len(state), path)


# safetensors dtypes a floating-point parameter can be loaded from.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def check_hf_weights(path: str, expected: dict[str, tuple[int, ...]] | None = None) -> None:
    """Every *.safetensors of the HF directory `path`, before any process loads it: a regular file
    (runtime/inputs.py), a header safetensors itself accepts (sizes, offsets and lengths within the
    file), floating-point tensors only (integer weights cannot fill a float parameter), and, given
    `expected` ({HF name: shape}, hf_state_dict of the model built on meta), every tensor the model
    needs, in its shape. One ConfigError line naming model.hf and the file otherwise. Reads the
    headers, not the weights."""
    from pathlib import Path

    from safetensors import safe_open

    from meshrun.errors import ConfigError
    from meshrun.runtime.inputs import user_file

    fix = "save the model again with save_pretrained"
    found: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (file, shape)
    for file in sorted(Path(path).expanduser().glob("*.safetensors")):
        real = user_file("model.hf", file, fix=fix)
        try:
            with safe_open(str(real), framework="pt") as weights:
                slices = {name: weights.get_slice(name) for name in weights.keys()}  # noqa: SIM118
                header = {name: (piece.get_dtype(), tuple(piece.get_shape())) for name, piece in slices.items()}
        except Exception as exc:  # noqa: BLE001 - SafetensorError and what its parser raises
            text = " ".join(str(exc).split())[:200]
            raise ConfigError(f"model.hf={path!r}: {file.name} is not a valid safetensors file "
                              f"({type(exc).__name__}: {text}); {fix}") from None
        bad = {name: dtype for name, (dtype, _) in header.items() if dtype not in FLOAT_DTYPES}
        if bad:
            name, dtype = next(iter(sorted(bad.items())))
            raise ConfigError(f"model.hf={path!r}: {file.name} holds {len(bad)} non-floating-point tensor(s), "
                              f"e.g. {name} as {dtype}; a model's weights are F32, F16 or BF16: {fix}")
        found.update({name: (file.name, shape) for name, (_, shape) in header.items()})
    if expected is None:
        return
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ConfigError(f"model.hf={path!r}: its safetensors lack {len(missing)} tensor(s) the model needs, "
                          f"e.g. {missing[0]}; {fix}")
    wrong = sorted(name for name, shape in expected.items() if found[name][1] != tuple(shape))
    if wrong:
        name = wrong[0]
        raise ConfigError(f"model.hf={path!r}: {found[name][0]} holds {name} as {list(found[name][1])}, "
                          f"but config.json makes it {list(expected[name])} ({len(wrong)} tensor(s) differ); {fix}")
