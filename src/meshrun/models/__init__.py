"""Models: the built-in Llama-style decoder (args.py: its shape; llama.py: its modules), its named
sizes, and the user-model plug-in (factory.py).

from meshrun.models import build_model, get_size, Transformer
model = Transformer(get_size("tiny"), seed=0)      # or build_model(cfg.model, vocab_size)
"""

from __future__ import annotations

from meshrun.models.args import ModelArgs, auto_ffn_hidden, flops_per_token
from meshrun.models.factory import (
    ModelProtocol,
    build_meta_model,
    build_model,
    load_factory,
    model_args_from_config,
)
from meshrun.models.llama import (
    Attention,
    FeedForward,
    Transformer,
    TransformerBlock,
    num_params,
)
from meshrun.models.sizes import DEFAULT_SIZE, SIZES, get_size

__all__ = [
    "DEFAULT_SIZE",
    "SIZES",
    "Attention",
    "FeedForward",
    "ModelArgs",
    "ModelProtocol",
    "Transformer",
    "TransformerBlock",
    "auto_ffn_hidden",
    "build_meta_model",
    "build_model",
    "flops_per_token",
    "get_size",
    "load_factory",
    "model_args_from_config",
    "num_params",
]
