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

    state = hf_state_dict(parts)
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": one process is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
    except Exception as exc:  # noqa: BLE001 - DCP wraps per-rank failures; one line names the dir
        text = " ".join(str(exc).split())
        raise ModelError(f"model.hf={path!r}: cannot load its safetensors into the model "
                         f"({type(exc).__name__}: {text[:300]})") from exc
    for part in parts:
        inner = getattr(part, "module", part)
        if hasattr(inner, "weights_pending"):
            inner.weights_pending = False
    logger.info("loaded %d tensors from %s", len(state), path)
