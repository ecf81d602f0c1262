"""Build a model on the meta device without running its weight initialisation.

    with on_meta():
        model = Transformer(args)        # shapes only; no storage, no init kernels

A module's constructor fills its weights (``nn.init.normal_``, ``tensor.uniform_``...). On the
meta device that fills nothing, yet torch 2.13 still routes a meta ``normal_``
through ``torch._refs``, whose decorator imports ``torch._dynamo``: 1.5-3 s of CPU in every process that
only wants shapes (the launcher's memory check, the plan, each worker's lazy build). Inside
``on_meta()`` those fills return their meta tensor unchanged; every other call runs as usual, and
on a real device nothing changes. The weights are filled later by ``init_weights(seed)`` or a
checkpoint, after the layout has placed them. (Other ops on meta tensors, `arange` or a
division, take the same route: a model's derived buffers are better left empty on meta, as
llama.Transformer does with its RoPE tables.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def _filler_methods() -> frozenset:
    import torch

    names = ("normal_", "uniform_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_",
             "bernoulli_", "fill_", "zero_")
    return frozenset(getattr(torch.Tensor, name) for name in names)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """``torch.device("meta")`` with weight fills (torch.nn.init, in-place random fills) skipped."""
    import torch
    from torch.overrides import TorchFunctionMode

    fillers = _filler_methods()

    class _SkipFills(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
            kwargs = kwargs or {}
            if func in fillers or getattr(func, "__module__", None) == "torch.nn.init":
                target = args[0] if args else kwargs.get("tensor")
                if isinstance(target, torch.Tensor) and target.is_meta:
                    return target
            return func(*args, **kwargs)

    with torch.device("meta"), _SkipFills():
        yield


def retie_output(model) -> None:  # noqa: ANN001 - a built-in or model.hf decoder
    """Point a tied output projection back at the embedding's weight: `to_empty` (storage for a
    meta build, real or fake) gives each module its own new Parameter, which unties them (torch
    2.13). A model without a tied head is left as it is."""
    output, embedding = getattr(model, "output", None), getattr(model, "tok_embeddings", None)
    if (getattr(getattr(model, "args", None), "tie_embeddings", False) and output is not None
            and embedding is not None and output.weight is not embedding.weight):
        output.weight = embedding.weight
