"""Build the model from the ``[model]`` config section: a named size of the built-in decoder, or a
user's own ``model.factory = "pkg.module:fn"``."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from meshrun.errors import ModelError
from meshrun.models.from_config import ARG_FIELDS, model_args_from_config  # noqa: F401 - re-exported
from meshrun.models.llama import Transformer
from meshrun.models.meta import on_meta

logger = logging.getLogger(__name__)

@runtime_checkable
class ModelProtocol(Protocol):
    """What meshrun needs from a model, and what it can use when a model offers more.

    Required: an ``nn.Module`` whose ``forward(tokens)`` maps int64 token ids (B, T) to logits
    (B, T, vocab_size); the trainer applies the next-token cross-entropy. That is all DDP needs.

    Optional, each unlocking more (the built-in ``Transformer`` has them all):

    - ``layers: nn.ModuleDict`` of the repeated blocks, keyed by name: FSDP shards each block
      on its own (bottom-up ``fully_shard``), activation checkpointing wraps each block, and a
      pipeline split deletes blocks from it while the names stay stable.
    - ``tok_embeddings``, ``norm``, ``output`` attributes that forward skips when None: what a
      pipeline stage sets to None when it does not own them. Without ``tok_embeddings`` the
      input is hidden states (B, T, dim).
    - ``init_weights(seed: int | None) -> None``: re-initialises every parameter (and
      recomputes non-persistent buffers) deterministically, so a model built on the ``meta``
      device can be materialised with ``to_empty()`` and then filled, identically on every rank.

    This class is for reading and ``isinstance`` checks on ``forward``; it does not require the
    optional attributes (use ``hasattr``).
    """

    def forward(self, tokens: torch.Tensor) -> torch.Tensor: ...


def build_model(
    model_cfg: Any, vocab_size: int | None = None, *, seed: int | None = None
) -> nn.Module:
    """The model the config describes.

    ``model_cfg`` is any object with the ``[model]`` attributes (``name``, ``factory`` and the
    ModelArgs fields); missing attributes count as empty. With ``factory`` set, the user's
    function builds the model (called as ``fn(model_cfg, vocab_size)`` or ``fn()``, by its
    signature); otherwise the built-in ``Transformer`` of the named size, initialised with
    ``init_weights(seed)``. Build under ``with torch.device("meta"):`` to defer allocation.
    ``model.init_from`` is not read here: the weights are checkpoint/export.py's to load
    (``load_consolidated``), as the trainer does.
    """
    factory = getattr(model_cfg, "factory", None)
    hf = getattr(model_cfg, "hf", "")
    if hf:  # a Hugging Face directory: transformers builds it, meshrun's adapter lays it out
        from meshrun.models.hf import build_hf_model

        return build_hf_model(hf, vocab_size, seed=seed, tie_embeddings=getattr(model_cfg, "tie_embeddings", None))
    if factory:
        fn = load_factory(factory)
        model = _call_factory(factory, fn, model_cfg, vocab_size)
        if not isinstance(model, nn.Module):
            raise ModelError(
                f"model.factory={factory!r} returned {type(model).__name__}, not a torch.nn.Module"
            )
    else:
        model = Transformer(model_args_from_config(model_cfg, vocab_size), seed=seed)
    return model


def build_meta_model(
    model_cfg: Any, vocab_size: int | None = None, *, seed: int | None = None
) -> nn.Module:
    """The model on the meta device (shapes, no storage) when ``init_weights`` can fill it later.

    The layout then shards it and materialises only this rank's share (``to_empty`` +
    ``init_weights(seed)``, or ``model.init_from`` loaded after that). A user model without
    ``init_weights`` (or one that cannot be built on meta) is built eagerly instead, as
    ``build_model`` does, with one log line: every rank then holds the whole model at start-up.
    """
    try:
        with on_meta():
            model = build_model(model_cfg, vocab_size, seed=seed)
        reason = None if hasattr(model, "init_weights") else "has no init_weights(seed)"
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code failed on meta tensors: build it eagerly
        reason, model = f"cannot be built on the meta device ({_one_line(exc)})", None
    if reason is None:
        return model
    logger.warning(
        "model.factory=%r %s, so every rank builds the whole model in memory before sharding it; "
        "give the model an init_weights(seed) method to build it on the meta device",
        getattr(model_cfg, "factory", None), reason,
    )
    return build_model(model_cfg, vocab_size, seed=seed)


def load_factory(spec: str) -> Any:
    """Resolve ``"pkg.module:fn"`` (or ``"pkg.module:Class.method"``) to a callable."""
    where = f"model.factory={spec!r}"
    module_name, sep, attr_path = str(spec).partition(":")
    if not sep or not module_name or not attr_path:
        raise ModelError(f"{where} must have the form 'pkg.module:function'")
    module = _import(module_name, where)
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"{where}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(f"{where}: {attr_path!r} is a {type(obj).__name__}, not callable")
    return obj


def _import(module_name: str, where: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Console scripts do not put the working directory on sys.path, but a user's
        # "mymodel:build" next to the config is the common case: retry with it (appended last).
        cwd = os.getcwd()
        top = module_name.split(".")[0]
        if exc.name == top and cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)
            return _import(module_name, where)
        raise ModelError(f"{where}: cannot import {module_name!r} ({_one_line(exc)})") from exc
    except Exception as exc:  # an error raised while the user's module runs
        raise ModelError(f"{where}: cannot import {module_name!r} ({_one_line(exc)})") from exc


def _call_factory(spec: str, fn: Any, model_cfg: Any, vocab_size: int | None) -> Any:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: use the full form
        return fn(model_cfg, vocab_size)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_kw = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    if required_kw or len(required) > 2:
        raise ModelError(
            f"model.factory={spec!r}: the function must take (model_cfg, vocab_size) or no "
            f"arguments, but its signature is {sig}"
        )
    if varargs or len(positional) >= 2:
        return fn(model_cfg, vocab_size)
    if len(positional) == 1:
        return fn(model_cfg)
    return fn()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
