"""Where a transformers causal LM keeps the pieces meshrun lays out, and the stand-ins a pipeline
stage puts in transformers' module tree (models/hf.py's adapter uses both).

`HFParts.find(hf)` reads the module tree: the base model (the module holding the input embedding),
the one list of num_hidden_layers decoder layers, the final norm (the one module with parameters
that runs after the layers: the order is seen in a forward on the meta device when registration
order could mislead, as OPT's `final_layer_norm`), the head, input parts (parameters before the
layers: GPT-2's `wpe`) and buffer-only extras (rotary tables). A stage's stand-ins: `_Skip` for a
layer it does not own, `_Enter` feeding the stage input to its first layer, `_Leave` ending the
stage at its last layer (`_StageDone`), `_Stub` for an input part it does not own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshrun.errors import ModelError


def _has_state(module: nn.Module) -> tuple[bool, bool]:
    """(has parameters, has buffers), anywhere below `module`."""
    return (next(module.parameters(), None) is not None, next(module.buffers(), None) is not None)


@dataclass(frozen=True)
class HFParts:
    """Where meshrun's pieces sit in a transformers causal LM (attribute names)."""

    base: str
    """the causal LM's base model (`base_model_prefix`: "model", "transformer", "gpt_neox")"""
    embed: str
    layers: str
    norm: str | None
    head: str
    input_parts: tuple[str, ...]
    extras: tuple[str, ...]
    unordered: tuple[str, ...] = ()
    """input parts registered before the layers whose place in the forward could not be seen (a
    forward that does not run on the meta device): a pipeline split would guess, so it is refused"""

    @classmethod
    def find(cls, hf: nn.Module, where: str) -> HFParts:
        """The pieces of `hf`, or one ModelError line saying which one is not where a decoder-only
        causal LM has it."""
        def refuse(what: str) -> ModelError:
            return ModelError(f"{where} ({type(hf).__name__}): {what}; meshrun trains decoder-only causal LMs "
                              "(an embedding, one list of decoder layers, a final norm, a head)")

        embed, head = hf.get_input_embeddings(), hf.get_output_embeddings()
        # The base model is the module that holds the input embedding as a direct child: usually
        # `base_model_prefix` ("model", "transformer"), but OPT's is `model.decoder` and
        # Llama4ForCausalLM's prefix ("language_model") names no attribute.
        prefix = next((n for n, m in hf.named_modules() if m is not hf
                       and any(c is embed for c in m.children())), None)
        if prefix is None:
            raise refuse("no base model under the head")
        base = hf.get_submodule(prefix)
        base_children = list(base.named_children())
        embed_name = next(n for n, m in base_children if m is embed)
        head_name = next((n for n, m in hf.named_children() if m is head), None)
        if head_name is None:
            raise refuse("its output head is not a direct child of the model")
        # every module on the path from the causal LM down to the base holds nothing else with state
        others, path = [], ""
        for step in prefix.split("."):
            holder = hf.get_submodule(path)
            others += [f"{path}.{n}".lstrip(".") for n, m in holder.named_children()
                       if n != step and not (holder is hf and n == head_name) and any(_has_state(m))]
            path = f"{path}.{step}".lstrip(".")
        if others:
            raise refuse(f"it holds more than a decoder ({', '.join(others)})")
        n_layers = int(hf.config.get_text_config().num_hidden_layers)
        lists = [n for n, m in base_children if isinstance(m, nn.ModuleList) and len(m) == n_layers]
        if len(lists) != 1:
            raise refuse(f"{'no' if not lists else 'more than one'} list of num_hidden_layers={n_layers} decoder layers")
        order = [n for n, _ in base_children]
        ahead = [n for n, m in base_children[:order.index(lists[0])] if n != embed_name and _has_state(m)[0]]
        unordered: list[str] = []
        if ahead:  # registered before the layers is not always run before them (OPT's final_layer_norm)
            run = _run_order(hf, base, where)
            order, unordered = (run, []) if run else (order, ahead)
        at = order.index(lists[0])
        norm, input_parts, extras = [], [], []
        for name, module in base_children:
            if name in (embed_name, lists[0]):
                continue
            params, buffers = _has_state(module)
            if params and order.index(name) > at:
                norm.append(name)
            elif params:
                input_parts.append(name)
            elif buffers:
                extras.append(name)
        if len(norm) > 1:
            raise refuse(f"more than one module with parameters after the decoder layers ({', '.join(norm)})")
        return cls(prefix, embed_name, lists[0], norm[0] if norm else None, head_name,
                   tuple(input_parts), tuple(extras), tuple(unordered))

    @property
    def prefixes(self) -> tuple[tuple[str, str], ...]:
        """meshrun's top-level prefix -> transformers', for every piece (models/hf_keys.py)."""
        pairs = [("tok_embeddings.", f"{self.base}.{self.embed}."), ("layers.", f"{self.base}.{self.layers}."),
                 ("output.", f"{self.head}.")]
        if self.norm:
            pairs.append(("norm.", f"{self.base}.{self.norm}."))
        pairs += [(f"input_parts.{n}.", f"{self.base}.{n}.") for n in self.input_parts]
        pairs += [(f"extras.{n}.", f"{self.base}.{n}.") for n in self.extras]
        return tuple(pairs)


def _run_order(hf: nn.Module, base: nn.Module, where: str) -> list[str] | None:
    """The base model's children in the order its forward first calls them, from one forward of
    two tokens on a copy on the meta device (no compute); None when the model cannot run on meta
    (then the registration order stands)."""
    config = hf.config
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            probe = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
        path = next(n for n, m in hf.named_modules() if m is base)
        pbase = probe.get_submodule(path)
        seen: list[str] = []
        # a ModuleList is iterated, not called: its first module's call stands for it
        hooks = [(child[0] if isinstance(child, nn.ModuleList) and len(child) else child).register_forward_pre_hook(
                     lambda *_, n=name: seen.append(n) if n not in seen else None)
                 for name, child in pbase.named_children()]
        ids = torch.zeros((1, 2), dtype=torch.long, device="meta")
        try:
            for extra in ({}, {"attention_mask": torch.ones((1, 1, 2, 2), dtype=torch.bool, device="meta")}):
                seen.clear()  # without a mask; else with a 4-D one, which skips the masks' own .item() checks
                try:
                    with torch.no_grad():
                        probe(input_ids=ids, use_cache=False, **extra)
                    break
                except Exception:  # noqa: BLE001 - a forward that needs real values
                    seen.clear()
        finally:
            for hook in hooks:
                hook.remove()
    except Exception:  # noqa: BLE001 - not buildable on meta: the registration order
        return None
    if not seen:
        return None
    never = [n for n, _ in base.named_children() if n not in seen]
    return seen + never


def _annotated_arity(layer: nn.Module) -> int:
    """What the decoder layer class says its forward returns: 0 for the hidden states alone, n for
    a tuple of n with the hidden states first (Falcon, Bloom, Bamba, FalconH1: their base model
    does `outputs[0]` or `hidden_states, _ = layer(...)`), 1 for `tuple[Tensor, ...]`."""
    import types
    import typing

    try:
        hint = typing.get_type_hints(type(layer).forward).get("return")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: assume a tensor
        return 0
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for option in options:
        if typing.get_origin(option) is tuple:
            args = typing.get_args(option)
            return 1 if len(args) == 2 and args[1] is Ellipsis else max(len(args), 1)
    return 0


class _Skip(nn.Module):
    """A decoder layer before a later stage's first one: the hidden states pass through, in the
    structure the model's layers return (their result is discarded: `_Enter` replaces it)."""

    def __init__(self, arity: int = 0, attrs: dict | None = None):
        super().__init__()
        self.arity = arity
        # the skipped layer's plain attributes, which some loops read (NemotronH: `block_type`)
        self.__dict__.update({k: v for k, v in (attrs or {}).items() if k not in ("training", "arity")})

    def forward(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden_states if self.arity == 0 else (hidden_states,) + (None,) * (self.arity - 1)


class _StageDone(Exception):  # noqa: N818 - control flow, never seen outside forward
    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class _Around(nn.Module):
    """A decoder layer in a stand-in's place: attributes the model's loop reads on its layers
    (`attention_type`, `block_type`) are the layer's."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)


class _Leave(_Around):
    """The last decoder layer of a stage without the head: its hidden states are the stage's
    output, whatever the model does after the layers (its final norm, parameter-free or shared
    with the prologue as NanoChat's; the layers after this stage's)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        result = self.layer(*args, **kwargs)
        raise _StageDone(result[0] if isinstance(result, (tuple, list)) else result)  # OpenAI-GPT: a list


class _Stub(nn.Module):
    """An input part (GPT-2's `wpe`, Bloom's embedding norm) on a stage that does not own it. Its
    result is never used (`_Enter` replaces the hidden states it went into): the stage's input
    (hidden states, B x T x hidden) passes through, anything else (positions, a mask) gives a
    scalar 0, which adds to any shape."""

    def __init__(self, hidden: torch.Tensor | None):
        super().__init__()
        self.__dict__["_shape"] = tuple(hidden.shape) if hidden is not None else None

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and tuple(x.shape) == self.__dict__["_shape"]:
            return x
        return torch.zeros((), device=x.device if isinstance(x, torch.Tensor) else None)


class _Enter(_Around):
    """The first decoder layer of a stage that gets hidden states: the stage's input replaces the
    hidden states the model's own prologue made of it (position embeddings added, scaled...)."""

    def __init__(self, layer: nn.Module, hidden: torch.Tensor):
        super().__init__(layer)
        self.hidden = hidden

    def forward(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        return self.layer(self.hidden, *args, **kwargs)
