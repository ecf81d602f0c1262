"""Models: the built-in Llama-style decoder (args.py: its shape; llama.py: its modules), its named
sizes, and the user-model plug-in (factory.py).

from meshrun.models import build_model, get_size, Transformer
model = Transformer(get_size("tiny"), seed=0)      # or build_model(cfg.model, vocab_size)
"""

from __future__ import annotations

from typing import Any

from meshrun.models.args import ModelArgs, auto_ffn_hidden, flops_per_token
from meshrun.models.from_config import model_args_from_config
from meshrun.models.sizes import DEFAULT_SIZE, SIZES, get_size

# torch-backed names load on first use: the CLI reads model sizes before torch is imported.
_LAZY = {
    "ModelProtocol": "factory", "build_meta_model": "factory", "build_model": "factory", "load_factory": "factory",
    "Attention": "llama", "FeedForward": "llama", "Transformer": "llama", "TransformerBlock": "llama",
    "num_params": "llama",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"meshrun.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'meshrun.models' has no attribute {name!r}")


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
