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
    experts: int = 0
    """Routed experts of a mixture-of-experts feed-forward (meshrun.models.moe); 0 = dense."""
    experts_per_token: int = 2
    """Routed experts each token goes to (top-k), 1..experts."""
    shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeekMoE), 0 or more."""
    moe_every: int = 1
    """An MoE feed-forward in every moe_every-th block: block i when (i + 1) % moe_every == 0."""
    moe_hidden: int = 0
    """Width of one expert. 0 = auto: ffn_hidden / (experts_per_token + shared_experts), rounded up
    to a multiple of 8, so a token's active expert width is about the dense block's."""
    moe_balance: str = "bias"
    """Load balancing: 'bias' (DeepSeek-V3's aux-loss-free bias, sigmoid scores), 'aux_loss'
    (a sequence-wise balance loss, softmax scores) or 'none' (softmax scores)."""
    moe_aux_coef: float = 0.01
    """Weight of the balance loss under moe_balance='aux_loss'."""
    moe_bias_rate: float = 1e-3
    """Step of the bias update under moe_balance='bias' (DeepSeek-V3's gamma)."""

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
        self._check_moe()

    def _check_moe(self) -> None:
        """The mixture-of-experts keys; with experts = 0 the others are not read."""
        for key in ("experts", "shared_experts", "moe_hidden"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ModelError(f"model.{key} must be an integer >= 0, got {value!r}")
        if not self.experts:
            return
        k = self.experts_per_token
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.experts:
            raise ModelError(f"model.experts_per_token must be an integer from 1 to "
                             f"model.experts={self.experts}, got {k!r}")
        every = self.moe_every
        if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= self.n_layers:
            raise ModelError(f"model.moe_every must be an integer from 1 to model.n_layers={self.n_layers} "
                             f"(block i is MoE when (i + 1) % moe_every == 0), got {every!r}")
        if self.moe_balance not in MOE_BALANCE:
            raise ModelError(f"model.moe_balance must be one of {', '.join(map(repr, MOE_BALANCE))}, "
                             f"got {self.moe_balance!r}")
        for key in ("moe_aux_coef", "moe_bias_rate"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ModelError(f"model.{key} must be a number >= 0, got {value!r}")
        if self.moe_hidden == 0:
            active = self.experts_per_token + self.shared_experts
            self.moe_hidden = 8 * math.ceil(self.ffn_hidden / active / 8)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` has the mixture-of-experts feed-forward."""
        return self.experts > 0 and (layer_id + 1) % self.moe_every == 0

    @property
    def num_moe_layers(self) -> int:
        """How many blocks `is_moe_layer`: every moe_every-th, counted without a loop (a sized
        config may name billions of layers; the preflight refuses it, in one line, after this)."""
        return self.moe_layers_between(0, self.n_layers)

    def moe_layers_between(self, start: int, stop: int) -> int:
        """How many of blocks start..stop-1 are MoE blocks (`is_moe_layer`), by arithmetic."""
        return stop // self.moe_every - start // self.moe_every if self.experts > 0 else 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, exclude_embeddings: bool = False, active: bool = False) -> int:
        """Parameter count computed from the shapes (no weights needed); equals ``num_params(model)``.

        ``active``: count only what one token uses, its top-k routed experts of each MoE layer
        (plus the shared experts and the router), as MFU counts a mixture of experts."""
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        per_layer = attn + 2 * self.dim  # + attention_norm, ffn_norm
        dense_ffn = 3 * self.dim * self.ffn_hidden
        moe_layers = self.num_moe_layers
        n = self.n_layers * per_layer + (self.n_layers - moe_layers) * dense_ffn + self.dim  # + final norm
        if moe_layers:
            routed = self.experts_per_token if active else self.experts
            expert = 3 * self.dim * self.moe_hidden
            router = self.dim * self.experts
            n += moe_layers * ((routed + self.shared_experts) * expert + router)
        embedding = self.vocab_size * self.dim
        if not self.tie_embeddings:
            n += embedding  # the separate output projection
        if not exclude_embeddings:
            n += embedding  # the token embedding (the shared matrix, when tied)
        return n


MOE_BALANCE = ("bias", "aux_loss", "none")  # model.moe_balance


def _check_positive_int(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelError(f"model.{key} must be an integer > 0, got {value!r}")


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward): 6 N + 12 L H Q T.

    The estimate of PaLM (arXiv:2204.02311, appendix B) used by nanoGPT's ``estimate_mfu`` and
    torchtitan: N counts the matmul parameters (the embedding lookup is free, but the output
    projection is a matmul, so it is counted even when tied); 12 L H Q T is attention's
    QK^T and AV with L layers, H heads, head size Q and sequence length T (the causal mask is
    not discounted, as in PaLM). A mixture of experts counts its active parameters only: each
    token's top-k routed experts, the shared experts and the router (as torchtitan's MoE MFU).
    """
    n = args.num_params(exclude_embeddings=True, active=True)
    if args.tie_embeddings:
        n += args.vocab_size * args.dim
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
