"""Named sizes of the built-in decoder, from a CPU-friendly "tiny" to Llama-3-8B's shapes."""

from __future__ import annotations

import difflib
from typing import Any

from meshrun.errors import ModelError
from meshrun.models.args import ModelArgs

# The byte-level tokenizer: 256 bytes plus <eos>, <bos>, <pad>. build_model replaces it with the
# tokenizer's real vocabulary size; it matters only for params/FLOPs shown without a tokenizer.
BYTE_VOCAB = 259
LLAMA3_VOCAB = 128256

# Raw specs, not ModelArgs: ModelArgs resolves ffn_hidden=0 from dim, so overrides must be
# merged into these dicts before the args are built. Param counts are at BYTE_VOCAB (untied)
# for the first three and at the Llama 3 vocabulary for the last two.
SIZES: dict[str, dict[str, Any]] = {
    # ~0.85M params: several hundred steps of batch 16 x 128 on 2 CPU processes in minutes.
    "tiny": dict(
        vocab_size=BYTE_VOCAB,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=0,
        max_seq_len=256,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # tiny's shapes with a mixture of experts in every block: 4 routed experts (top 2) and one
    # shared, each 128 wide (384 / 3, so a token's active width is tiny's); ~1.25M params, ~0.86M active.
    "tiny-moe": dict(
        vocab_size=BYTE_VOCAB,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=0,
        max_seq_len=256,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
        experts=4,
        experts_per_token=2,
        shared_experts=1,
        moe_every=1,
        moe_hidden=0,
        moe_balance="bias",
    ),
    # ~12.8M params.
    "small": dict(
        vocab_size=BYTE_VOCAB,
        dim=384,
        n_layers=8,
        n_heads=6,
        n_kv_heads=2,
        ffn_hidden=0,
        max_seq_len=512,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # ~126M params (GPT-2-small class, with the parameters in blocks rather than a 50k vocab).
    "base": dict(
        vocab_size=BYTE_VOCAB,
        dim=768,
        n_layers=20,
        n_heads=12,
        n_kv_heads=4,
        ffn_hidden=0,
        max_seq_len=1024,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # Llama-3.2-1B shapes (1.24B with its vocabulary, tied), without Llama 3.1's RoPE scaling.
    "1b": dict(
        vocab_size=LLAMA3_VOCAB,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        max_seq_len=8192,
        tie_embeddings=True,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    # Llama-3-8B shapes (8.03B).
    "8b": dict(
        vocab_size=LLAMA3_VOCAB,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=8192,
        tie_embeddings=False,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    # Llama-3.1-70B shapes (70.6B), for planning (meshrun plan --simulate) more than for this machine.
    "70b": dict(
        vocab_size=LLAMA3_VOCAB,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
        max_seq_len=8192,
        tie_embeddings=False,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
}

DEFAULT_SIZE = "tiny"


def size_spec(name: str, *, key: str = "model.name") -> dict[str, Any]:
    """A copy of the raw spec of a named size (case-insensitive); ModelError with a suggestion."""
    spec = SIZES.get(str(name).strip().lower())
    if spec is None:
        valid = ", ".join(SIZES)
        close = difflib.get_close_matches(str(name).lower(), list(SIZES), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelError(f"{key}={name!r} is not a known model size; {hint}(valid: {valid})")
    return dict(spec)


def get_size(name: str, *, key: str = "model.name") -> ModelArgs:
    """The ModelArgs of a named size: one of ``tiny``, ``tiny-moe``, ``small``, ``base``, ``1b``, ``8b``, ``70b``."""
    return ModelArgs(**size_spec(name, key=key))
