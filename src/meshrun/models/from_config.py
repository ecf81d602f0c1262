"""ModelArgs of the built-in decoder from the `[model]` config section, without importing torch.

The CLI checks sizes (`meshrun.plan`'s memory estimate) before any worker or torch starts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from meshrun.errors import ModelError
from meshrun.models.args import ModelArgs
from meshrun.models.sizes import DEFAULT_SIZE, size_spec

if TYPE_CHECKING:
    from meshrun.parallel.resolve import ModelShape

ARG_FIELDS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden",
    "max_seq_len",
    "tie_embeddings",
    "rope_theta",
    "norm_eps",
    "experts",
    "experts_per_token",
    "shared_experts",
    "moe_every",
    "moe_hidden",
    "moe_balance",
    "moe_aux_coef",
    "moe_bias_rate",
)


def model_shape_from_config(model_cfg: Any, args: ModelArgs) -> ModelShape:
    """What the layout rules read of the config's model, `args` being its ModelArgs: a model.hf
    mixture of experts routes in transformers' code, so its routed experts come from config.json."""
    from meshrun.parallel.resolve import ModelShape

    shape = ModelShape.from_args(args)
    if getattr(model_cfg, "hf", ""):
        from meshrun.models.hf_config import hf_routed_experts

        shape = replace(shape, experts=hf_routed_experts(model_cfg.hf) or shape.experts)
    return shape


def model_args_from_config(model_cfg: Any, vocab_size: int | None = None) -> ModelArgs:
    """ModelArgs for the built-in decoder: the named size, with the config's non-empty fields on top.

    A field that is 0, None or "" takes the size's value (``tie_embeddings``: only None does, a
    bool is always explicit). ``vocab_size`` 0 takes the tokenizer's ``vocab_size`` argument.
    """
    if getattr(model_cfg, "hf", ""):  # a Hugging Face directory: its config.json gives the shape
        from meshrun.models.hf_config import model_args_from_hf

        args = model_args_from_hf(model_cfg.hf, vocab_size)
        if getattr(model_cfg, "tie_embeddings", None) is False and args.tie_embeddings:
            import dataclasses

            args = dataclasses.replace(args, tie_embeddings=False)  # untied by the config (models/hf.py)
        return args
    name = getattr(model_cfg, "name", None) or DEFAULT_SIZE
    spec = size_spec(name)
    for field in ARG_FIELDS:
        value = getattr(model_cfg, field, None)
        if field == "tie_embeddings":
            if value is not None:
                spec[field] = value
        elif value not in (0, None, ""):
            spec[field] = value
    cfg_vocab = getattr(model_cfg, "vocab_size", None)
    if vocab_size:
        if not cfg_vocab:
            spec["vocab_size"] = vocab_size
        elif cfg_vocab < vocab_size:
            raise ModelError(
                f"model.vocab_size={cfg_vocab} is smaller than the tokenizer's vocabulary "
                f"({vocab_size} ids); set model.vocab_size=0 to use the tokenizer's size"
            )
    return ModelArgs(**spec)
