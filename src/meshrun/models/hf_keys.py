"""State-dict names between meshrun's view of a Hugging Face causal LM and the HF checkpoint.

meshrun's layout code needs the built-in model's top-level names (`tok_embeddings`, `layers`, a
`nn.ModuleDict` keyed "0".."N-1", `norm`, `output`); a Hugging Face Llama-family checkpoint names
the same tensors `model.embed_tokens`, `model.layers.N`, `model.norm` and `lm_head` (the default
`prefixes` below); other architectures put them elsewhere (GPT-2: `transformer.wte`,
`transformer.h.N`, `transformer.ln_f`), and the adapter's `HFParts.prefixes` says where
(models/hf.py). Everything below keeps its HF name (`self_attn.q_proj`, `mlp.gate_proj`, ...).
This module is the one place that maps between the two: loading HF safetensors into meshrun's
shards, exporting a run back to HF, and `meshrun generate` all call it. Pure Python, no torch.
"""

from __future__ import annotations

# meshrun top-level prefix -> HF prefix, longest first where one is a prefix of another
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("tok_embeddings.", "model.embed_tokens."),
    ("layers.", "model.layers."),
    ("norm.", "model.norm."),
    ("rotary_emb.", "model.rotary_emb."),
    ("output.", "lm_head."),
)


Prefixes = tuple[tuple[str, str], ...]


def to_hf_key(name: str, prefixes: Prefixes = _PREFIXES) -> str:
    """`layers.0.self_attn.q_proj.weight` -> `model.layers.0.self_attn.q_proj.weight`."""
    for ours, theirs in sorted(prefixes, key=lambda pair: -len(pair[0])):
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise KeyError(f"{name!r} is not a name of meshrun's Hugging Face adapter")


def from_hf_key(name: str, prefixes: Prefixes = _PREFIXES) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `layers.0.self_attn.q_proj.weight`."""
    for ours, theirs in sorted(prefixes, key=lambda pair: -len(pair[1])):
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    raise KeyError(f"{name!r} is not a tensor name of this Hugging Face model")
