"""LoRA adapters on a frozen base, through peft: applied on the meta device, before the layout.

    model = build_meta_model(cfg.model, vocab)
    model = apply_lora(model, cfg.lora, base_dtype=torch.bfloat16)   # peft's LoRA layers, base frozen
    layout = build_layout(model, resolved, ...)                     # DDP / FSDP2 / HSDP as usual
    init_adapters(layout.parts, seed)                               # after the base weights exist
    fingerprint = base_fingerprint(layout.parts)                    # what a resume checks

`peft.inject_adapter_in_model` replaces each target `nn.Linear` by peft's `lora.Linear` in place:
the model keeps its class and its `layers`, so FSDP still shards it block by block (frozen and
LoRA parameters in one `fully_shard` unit train, measured on torch 2.13 CPU), and its base weight
is renamed `<module>.base_layer.weight` (Hu et al., "LoRA", arXiv:2106.09685;
https://huggingface.co/docs/peft/developer_guides/low_level_api).
"""

from __future__ import annotations

import hashlib
import math
import zlib

import torch
from torch import nn

from meshrun.errors import ConfigError
from meshrun.extras import import_extra

ADAPTER = "default"  # peft's adapter name
BASE_LAYER = ".base_layer."
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, compile


def lora_config(lora_cfg):
    """peft's LoraConfig for the `[lora]` section."""
    peft = import_extra("peft", f"lora.rank={lora_cfg.rank}", error=ConfigError)
    return peft.LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                           target_modules=list(lora_cfg.target_names))


def apply_lora(model: nn.Module, lora_cfg, *, base_dtype: torch.dtype | None = None) -> nn.Module:
    """`model` with LoRA layers on `lora_cfg.targets` and every other parameter frozen (in
    `base_dtype` when given: a bf16 base, fp32 adapters). Works on a meta-built model."""
    peft = import_extra("peft", f"lora.rank={lora_cfg.rank}", error=ConfigError)
    config = lora_config(lora_cfg)
    meta = any(p.is_meta for p in model.parameters())
    try:
        model = peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=meta)
    except ValueError as exc:
        linears = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"lora.targets={','.join(lora_cfg.target_names)!r} matches no layer peft can adapt "
                          f"({str(exc).splitlines()[0][:80]}); this model's linear layers are named "
                          f"{', '.join(linears[:12]) or 'nothing'}") from None
    if base_dtype is not None:
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(base_dtype)
    return model


def apply_run_lora(model: nn.Module, lora_cfg, train_dtype: str) -> nn.Module:
    """A run's model: with lora.rank > 0, `apply_lora`, the frozen base in bf16 for a bf16 run
    (fp32 adapters); else `model` as it is."""
    if not lora_cfg.enabled:
        return model
    return apply_lora(model, lora_cfg, base_dtype=torch.bfloat16 if train_dtype == "bf16" else None)


def clean_name(name: str) -> str:
    """A parameter's name without wrapper prefixes (DDP's `module.`, checkpointing's, compile's)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name.removeprefix("module.")


def base_name(name: str) -> str:
    """The base model's name of a LoRA model's parameter: `wq.base_layer.weight` -> `wq.weight`."""
    return clean_name(name).replace(BASE_LAYER, ".")


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in model.named_parameters())


@torch.no_grad()
def init_adapters(parts: list[nn.Module], seed: int | None) -> None:
    """Fill every adapter as peft does (A: Kaiming-uniform, B: zeros, so training starts at the
    base), each A from a generator keyed by (seed, name): the same values in every layout and on
    every rank (a DTensor gets its local shard of the same full tensor, without communication)."""
    seed = 0 if seed is None else seed
    for part in parts:
        for name, param in part.named_parameters():
            if ".lora_B." in name:
                param.zero_()
            elif ".lora_A." in name:
                key = clean_name(name)
                gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
                full = torch.empty(param.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
                param.copy_(_like(full, param))


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


@torch.no_grad()
def base_fingerprint(parts: list[nn.Module]) -> str:
    """sha256 over the frozen base weights (name, dtype, shape, bytes), the same in every layout.

    Every rank calls it (a sharded weight is gathered one at a time, a collective) and gets the
    same digest; a checkpoint records it, and a resume on other base weights is refused."""
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    frozen = {}
    for part in parts:
        for name, param in part.named_parameters():
            if not param.requires_grad:
                frozen[base_name(name)] = param
    for name in sorted(frozen):
        tensor = frozen[name]
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full = full.detach().cpu().contiguous()
        digest.update(f"{name}:{full.dtype}:{tuple(full.shape)};".encode())
        digest.update(full.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def trainable_names(part: nn.Module) -> set[str]:
    """The clean names of `part`'s trainable parameters (the adapters)."""
    return {clean_name(name) for name, param in part.named_parameters() if param.requires_grad}
