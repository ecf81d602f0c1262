"""The shape of the built-in decoder: ``ModelArgs``, its derived widths, and its FLOPs per token.

Kept apart from the modules (meshrun.models.llama) so that planning, sizes and validation read
shapes without building anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.errors import ModelError

# Llama rounds the SwiGLU width up to a multiple of 256; 64 keeps the tiny sizes tight
# (dim 128 -> 384 instead of 512) and is still a friendly GEMM width on GPUs.
FFN_MULTIPLE_OF = 64


def auto_ffn_hidden(dim: int, multiple_of: int = FFN_MULTIPLE_OF) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim (same FLOPs as a 4*dim GELU MLP), rounded up."""
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclass
class ModelArgs:
    """Shape of the built-in decoder. Values are validated here; errors name the ``model.`` key."""

    vocab_size: int = 259
    """Number of token ids (embedding rows and logits)."""
    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads; ``dim`` must be divisible by it (head_dim = dim // n_heads, even for RoPE)."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; must divide n_heads. 0 = n_heads (plain MHA)."""
    ffn_hidden: int = 0
    """SwiGLU hidden width. 0 = auto: 2/3 * 4 * dim rounded up to a multiple of 64."""
    max_seq_len: int = 256
    """Longest sequence; the RoPE tables are precomputed for this many positions."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Llama 2: 1e4, Llama 3: 5e5)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        # 0 means "derive it": resolve now so that a printed/saved config shows the real width.
        # (dataclasses.replace(args, dim=...) keeps the resolved values; rebuild from a dict instead.)
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            _check_positive_int(key, getattr(self, key))
        for key in ("n_kv_heads", "ffn_hidden"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ModelError(f"model.{key} must be an integer >= 0 (0 = auto), got {value!r}")
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden == 0:
            self.ffn_hidden = auto_ffn_hidden(self.dim)
        if self.n_heads % self.n_kv_heads:
            raise ModelError(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}"
            )
        if self.dim % self.n_heads:
            raise ModelError(
                f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ModelError(
                f"model.dim / model.n_heads = {self.head_dim} must be even for RoPE; "
                "change model.dim or model.n_heads"
            )
        for key in ("rope_theta", "norm_eps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ModelError(f"model.{key} must be a number > 0, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ModelError(
                f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count computed from the shapes (no weights needed); equals ``num_params(model)``."""
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        ffn = 3 * self.dim * self.ffn_hidden
        per_layer = attn + ffn + 2 * self.dim  # + attention_norm, ffn_norm
        n = self.n_layers * per_layer + self.dim  # + final norm
        embedding = self.vocab_size * self.dim
        if not self.tie_embeddings:
            n += embedding  # the separate output projection
        if not exclude_embeddings:
            n += embedding  # the token embedding (the shared matrix, when tied)
        return n


def _check_positive_int(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelError(f"model.{key} must be an integer > 0, got {value!r}")


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward): 6 N + 12 L H Q T.

    The estimate of PaLM (arXiv:2204.02311, appendix B) used by nanoGPT's ``estimate_mfu`` and
    torchtitan: N counts the matmul parameters (the embedding lookup is free, but the output
    projection is a matmul, so it is counted even when tied); 12 L H Q T is attention's
    QK^T and AV with L layers, H heads, head size Q and sequence length T (the causal mask is
    not discounted, as in PaLM).
    """
    n = args.num_params(exclude_embeddings=True)
    if args.tie_embeddings:
        n += args.vocab_size * args.dim
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
