"""A LoRA run's adapters on its base: the model rebuilt in one process, merged, or written for peft.

    model = lora_model(open_source(ckpt))          # the base as trained, peft's LoRA layers, the adapters
    source = merged(open_source(ckpt))             # a ModelSource of merged weights in the base's names
    export_peft(ckpt, out)                         # adapter_config.json + adapter_model.safetensors

A LoRA checkpoint (or model.pt) holds only the adapters (models/lora.py). The base comes from the
run's own config, as the trainer built it: `model.hf`'s safetensors, `model.init_from`, or the
built-in decoder's `init_weights(train.seed)`, in bf16 when train.dtype was bf16. A checkpoint's
recorded base fingerprint must match the base rebuilt here, so an export never puts adapters on
weights they were not trained on.

The adapters are read from the DCP checkpoint offline, each tensor whole, so none of the traps of
saving a sharded peft model apply (rank 0's shard only; `save_pretrained` on DTensors; merging
mixed Tensor/DTensor weights). Merging is peft's own (`LoraLayer.merge`); the peft directory uses
peft's file names and key layout (`base_model.model.<module>.lora_A.weight`), which
`PeftModel.from_pretrained(base, OUT)` loads (https://huggingface.co/docs/peft).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from meshrun.errors import ConfigError
from meshrun.models.lora import ADAPTER, apply_lora, base_fingerprint, base_name, is_adapter
from meshrun.trained.model_source import ModelSource

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def has_adapters(source: ModelSource) -> bool:
    return any(is_adapter(name) for name in source.names)


def _job_config(source: ModelSource):
    from meshrun.config.loader import config_from_dict

    cfg = config_from_dict(source.config, source=str(source.path))
    if not cfg.lora.enabled:
        raise ConfigError(f"{source.path} holds LoRA adapters but its config has lora.rank=0")
    return cfg


def _base(cfg) -> nn.Module:
    """The run's base model, eager on the CPU, with the weights the trainer started from."""
    from meshrun.checkpoint.export import load_consolidated
    from meshrun.data.tokenizer import load_tokenizer
    from meshrun.models.factory import build_model

    vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    model = build_model(cfg.model, vocab, seed=cfg.train.seed)  # model.hf: its safetensors are loaded
    if cfg.model.init_from:
        load_consolidated(model, cfg.model.init_from)
    return model


def lora_model(source: ModelSource) -> nn.Module:
    """The base as trained (frozen, its dtype) with peft's LoRA layers holding the source's adapters."""
    cfg = _job_config(source)
    model = apply_lora(_base(cfg), cfg.lora, base_dtype=torch.bfloat16 if cfg.train.dtype == "bf16" else None)
    expected = {clean for clean in model.state_dict() if is_adapter(clean)}
    if set(source.names) != expected:
        odd = sorted(set(source.names) ^ expected)[:3]
        raise ConfigError(f"{source.path}: its adapters do not fit the config's model and [lora] (differ at {odd}); "
                          "was the run's config.toml changed after training?")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name in source.names:
            params[name].copy_(source.read(name))
    _check_fingerprint(source, model)
    return model.eval()


def _check_fingerprint(source: ModelSource, model: nn.Module) -> None:
    from meshrun.checkpoint import manifest as mf

    state = source.path / mf.TRAIN_STATE
    if not state.is_file():  # model.pt: the final checkpoint of the run recorded it
        return
    recorded = torch.load(state, weights_only=True).get("base_fingerprint")
    now = base_fingerprint([model])
    if recorded and recorded != now:
        raise ConfigError(f"{source.path} was trained on base weights with fingerprint {recorded}, but its config's "
                          f"base now has {now}: the model.hf / model.init_from files changed since training")


def merged(source: ModelSource) -> ModelSource:
    """A ModelSource of the merged model (base + scale * B @ A, by peft's `merge`), in the base's names."""
    from peft.tuners.lora import LoraLayer

    model = lora_model(source)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.merge(safe_merge=True, adapter_names=[ADAPTER])
    state = {base_name(k): v.detach() for k, v in model.state_dict().items() if not is_adapter(k)}
    specs = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    return ModelSource(source.path, source.config, source.run_dir, specs, lambda name: state[name])


def peft_names(source: ModelSource) -> dict[str, tuple[str, int]]:
    """meshrun adapter name -> (peft's key, RoPE heads whose rows to permute, or 0), HF module names."""
    from meshrun.models.hf_keys import to_hf_key
    from meshrun.models.to_hf import builtin_to_adapter

    cfg = _job_config(source)
    if cfg.model.hf:
        from meshrun.models.hf import hf_parts

        prefixes = hf_parts(cfg.model.hf, cfg.model.tie_embeddings).prefixes
        to_hf = lambda weight: to_hf_key(weight, prefixes)  # noqa: E731
        heads = {}
    else:
        from meshrun.models.from_config import model_args_from_config

        args = model_args_from_config(cfg.model, None)
        to_hf = lambda weight: to_hf_key(builtin_to_adapter(weight))  # noqa: E731
        heads = {"wq": args.n_heads, "wk": args.n_kv_heads}  # built-in RoPE pairs -> HF halves (models/to_hf.py)
    out = {}
    for name in source.names:
        module, _, rest = name.partition(".lora_")
        which = rest.split(".", 1)[0]  # A or B
        hf_module = to_hf(module + ".weight").removesuffix(".weight")
        rope = heads.get(module.rsplit(".", 1)[-1], 0) if which == "B" else 0
        out[name] = (f"base_model.model.{hf_module}.lora_{which}.weight", rope)
    return out


def export_peft(ckpt: Path, out: Path, *, force: bool = False) -> dict:
    """Write CKPT's adapters as a peft adapter directory at OUT (for `PeftModel.from_pretrained`)."""
    from safetensors.torch import save_file

    from meshrun.checkpoint.outputs import check_output
    from meshrun.models.lora import lora_config
    from meshrun.models.to_hf import rope_permute
    from meshrun.trained.model_source import open_source

    check_output("OUT", out, inputs=[ckpt], writes=[out / ADAPTER_CONFIG, out / ADAPTER_WEIGHTS], force=force)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory; --format peft writes a directory: give a new path")
    source = open_source(ckpt)
    if not has_adapters(source):
        raise ConfigError(f"{ckpt} holds no LoRA adapters (its run had lora.rank=0); export the whole model "
                          "with --format hf or --format safetensors")
    cfg = _job_config(source)
    lora_model(source)  # the adapters fit the config's model, on the base they were trained on
    names = peft_names(source)
    tensors = {}
    for name, (key, heads) in names.items():
        tensor = source.read(name).float()
        tensors[key] = (rope_permute(tensor, heads) if heads else tensor).contiguous()
    targets = sorted({key.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for key, _ in names.values()})
    config = lora_config(cfg.lora)
    config.target_modules = targets
    config.task_type = "CAUSAL_LM"
    config.base_model_name_or_path = str(Path(cfg.model.hf).resolve()) if cfg.model.hf else None
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if not out.exists():
            tmp.rename(out)
        else:  # --force: only this export's files are replaced
            for new_file in tmp.iterdir():
                new_file.replace(out / new_file.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"out": str(out), "tensors": len(tensors), "targets": targets}
