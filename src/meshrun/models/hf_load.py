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
import sys

import torch
from torch import nn

from meshrun.errors import ModelError
from meshrun.models.hf_keys import _PREFIXES, to_hf_key

logger = logging.getLogger(__name__)


def hf_state_dict(parts: list[nn.Module]) -> dict:
    """The parts' parameters keyed by HF checkpoint names (each part's own `parts.prefixes`,
    models/hf.py); a tied output projection is left out (it is the embedding's tensor, and HF
    checkpoints do not store `lm_head.weight` then), and so is a head untied by
    model.tie_embeddings=false (the files hold none: `head_from_embedding` loads it). LoRA layers
    (models/lora.py) give their base weight its HF name and keep their adapters out."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state: dict = {}
    for part in parts:
        inner = getattr(part, "module", part)  # DDP
        prefixes = inner.parts.prefixes if hasattr(inner, "parts") else _PREFIXES
        skip_head = getattr(inner, "tied", False) or getattr(inner, "head_from_embedding", False)
        for name, tensor in get_model_state_dict(part).items():
            if (skip_head and name == "output.weight") or ".lora_" in name:  # LoRA adapters: not in the files
                continue
            state[to_hf_key(name.replace(".base_layer.", "."), prefixes)] = tensor  # a LoRA layer's base
    return state


def _untied_heads(parts: list[nn.Module]) -> dict:
    """{HF name of the embedding: the head's tensor} for a head untied by model.tie_embeddings=false."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state: dict = {}
    for part in parts:
        inner = getattr(part, "module", part)
        if getattr(inner, "head_from_embedding", False) and inner.output is not None:
            head = get_model_state_dict(part).get("output.weight")
            if head is not None:
                state[to_hf_key("tok_embeddings.weight", inner.parts.prefixes)] = head
    return state


def load_hf_weights(parts: list[nn.Module], path: str) -> None:
    """Fill `parts` (this rank's materialised share of an `HFCausalLM`) from the safetensors in
    `path`; one ModelError line when the files do not hold what the model needs."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = hf_state_dict(parts)
    if not _names_in_files(path, state):
        _load_converted(parts, path)
        return
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": one process is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
            heads = _untied_heads(parts)
            if heads or _any_untied(parts):  # collective: every rank calls it when any part is untied
                dcp.load(heads, storage_reader=dcp.HuggingFaceStorageReader(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps per-rank failures (a BaseException)
        text = " ".join(str(exc).split())
        raise ModelError(f"model.hf={path!r}: cannot load its safetensors into the model "
                         f"({type(exc).__name__}: {text[:300]})") from exc
    for part in parts:
        inner = getattr(part, "module", part)
        if hasattr(inner, "weights_pending"):
            inner.weights_pending = False
    logger.info("loaded %d tensors from %s", len(state), path)


def _file_names(path: str) -> set[str]:
    from pathlib import Path

    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(Path(path).expanduser().glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            names.update(weights.keys())
    return names


def _names_in_files(path: str, state: dict) -> bool:
    """Whether the safetensors store every tensor under its module's name (Llama, Qwen, Gemma...),
    rather than in a layout transformers converts when it loads (experts one by one, renamed heads).
    The same answer on every rank (a pipeline stage may hold only names that match): all ranks
    must then take the same path, the direct one being collective."""
    import torch.distributed as dist

    found = set(state) <= _file_names(path)
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([int(found)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        found = bool(flag.item())
    return found


def _load_converted(parts: list[nn.Module], path: str) -> None:
    """The weights of a directory whose files transformers converts on load (a mixture of experts
    stored expert by expert, fused into one tensor per layer in the model; GPT-NeoX's `embed_out`
    for `lm_head`): transformers loads the whole model once on this rank's CPU, with its own
    conversions, and each part copies its slices from it. One full copy per rank while loading
    (the direct path reads only this rank's slices); logged."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import AutoModelForCausalLM

    logger.warning("model.hf=%r stores its weights in a layout transformers converts when loading; each rank "
                   "loads the whole model once on the CPU to take its shards from it", path)
    untie = any(getattr(getattr(p, "module", p), "head_from_embedding", False) for p in parts)
    try:
        kwargs = {"tie_word_embeddings": False} if untie else {}
        hf, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                        trust_remote_code=False, output_loading_info=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers' loader: one line
        text = " ".join(str(exc).split())
        raise ModelError(f"model.hf={path!r}: transformers cannot load its weights ({type(exc).__name__}: "
                         f"{text[:300]})") from exc
    # an untied head is missing from a tied model's files by design: it is copied from the embedding below
    heads = {to_hf_key("output.weight", getattr(p, "module", p).parts.prefixes) for p in parts} if untie else set()
    missing = sorted(set(info.get("missing_keys") or []) - heads) + sorted(str(k) for k in info.get("mismatched_keys") or [])
    if missing:
        raise ModelError(f"model.hf={path!r}: its safetensors lack or misshape {len(missing)} tensor(s) the model "
                         f"needs, e.g. {missing[0]}; save the model again with save_pretrained")
    full = hf.state_dict()
    with torch.no_grad():
        for part in parts:
            inner = getattr(part, "module", part)
            prefixes = inner.parts.prefixes
            for name, tensor in get_model_state_dict(part).items():
                key = to_hf_key(name, prefixes)
                source = full.get(key)
                if name == "output.weight" and getattr(inner, "head_from_embedding", False):
                    # the files hold no head: transformers (tie_word_embeddings=False) gave it random values
                    source = full[to_hf_key("tok_embeddings.weight", prefixes)]
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                local.copy_(local_like(source, tensor).to_local() if hasattr(tensor, "to_local")
                            else source.to(dtype=tensor.dtype))
            if hasattr(inner, "weights_pending"):
                inner.weights_pending = False
    del hf, full


def _any_untied(parts: list[nn.Module]) -> bool:
    return any(getattr(getattr(p, "module", p), "head_from_embedding", False) for p in parts)


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
    if missing and converted_on_load(path):
        return  # stored in the layout transformers converts (experts one by one): its loader checks them
    if missing:
        raise ConfigError(f"model.hf={path!r}: its safetensors lack {len(missing)} tensor(s) the model needs, "
                          f"e.g. {missing[0]}; {fix}")
    wrong = sorted(name for name, shape in expected.items() if found[name][1] != tuple(shape))
    if wrong:
        name = wrong[0]
        raise ConfigError(f"model.hf={path!r}: {found[name][0]} holds {name} as {list(found[name][1])}, "
                          f"but config.json makes it {list(expected[name])} ({len(wrong)} tensor(s) differ); {fix}")


def converted_on_load(path: str) -> bool:
    """Whether transformers converts checkpoints of this directory's model_type when it loads them
    (a mixture of experts stored expert by expert, as Mixtral's and Qwen-MoE's are published):
    their file names then differ from the model's, and _load_converted takes that path."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from meshrun.models.hf_config import read_hf_config

    return bool(get_checkpoint_conversion_mapping(read_hf_config(path).get("model_type")))


def local_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full` as `param`'s kind of tensor: a DTensor parameter gets its local slice, no communication."""
    full = full.to(device=param.device, dtype=param.dtype)
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(param, DTensor):
            return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full
