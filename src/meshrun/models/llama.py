"""The built-in Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, tied embeddings.

Shapes follow Meta's Llama reference and torchtitan's ``llama3`` model so that parallel plans can
address blocks by name: ``tok_embeddings``, ``layers.<i>.attention.{wq,wk,wv,wo}``,
``layers.<i>.feed_forward.{w1,w2,w3}`` (or, in a mixture-of-experts block, the ``MoE`` of
meshrun.models.moe), ``layers.<i>.{attention_norm,ffn_norm}``, ``norm``, ``output``. ``layers``
is an ``nn.ModuleDict`` keyed ``"0".."N-1"``, so a pipeline stage can delete blocks (and set
``tok_embeddings``/``norm``/``output`` to None) and keep the original names.

Papers: Llama (arXiv:2302.13971), RoPE (arXiv:2104.09864), SwiGLU (arXiv:2002.05202),
GQA (arXiv:2305.13245), RMSNorm (arXiv:1910.07467).
"""

from __future__ import annotations

import math
import sys
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from meshrun.errors import ModelError
from meshrun.models.args import (  # noqa: F401 - re-exported: the model's shape, where it was first defined
    FFN_MULTIPLE_OF,
    ModelArgs,
    auto_ffn_hidden,
    flops_per_token,
)
from meshrun.models.feed_forward import FeedForward
from meshrun.models.meta import retie_output
from meshrun.models.moe import MoE


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the RoPE angles, each (max_seq_len, head_dim // 2), in float32 (arXiv:2104.09864)."""
    freqs = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x: (B, T, H, head_dim) by position; cos/sin:
    (T, head_dim/2), or (B, T, head_dim/2) with each row's own positions.

    Same pairing as Meta's complex-number reference, so its checkpoints load unpermuted.
    """
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos = cos.unsqueeze(-2)  # broadcast over the heads (and the batch, for (T, head_dim/2))
    sin = sin.unsqueeze(-2)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def block_causal_mask(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document index of each column -> (B, 1, T, T) bool: a query attends the keys at or
    before it in its own document (packed examples never see each other)."""
    seqlen = documents.shape[-1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (arXiv:2305.13245)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: (B, 1, T, T) bool, True where a query may attend a key (packed examples'
        block-causal mask, `block_causal_mask`); None = causal over the whole row."""
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, head_dim)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            # Explicit repeat (as torchtitan's repeat_kv) rather than enable_gqa: works on every
            # SDPA backend and under DTensor.
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # a boolean mask: SDPA's CPU flash kernel and CUDA's efficient kernel both take it
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + feed_forward(norm(h))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id  # kept for depth-scaled init after PP removes earlier blocks
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward: FeedForward | MoE = (
            MoE(args, layer_id) if args.is_moe_layer(layer_id) else FeedForward(args.dim, args.ffn_hidden)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # the mask by keyword: tensor parallel's input plan (parallel/tp.py) lays out the positional ones
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only transformer: ``model(tokens) -> logits`` of shape (B, T, vocab_size).

    For pipeline stages, any of ``tok_embeddings``, ``norm`` and ``output`` may be set to None and
    blocks deleted from ``layers``: without ``tok_embeddings`` the input is hidden states
    (B, T, dim); without ``output`` the result is hidden states. ``seed`` is passed to
    ``init_weights`` (None: drawn from torch's default generator).
    """

    # One inductor graph can hold the whole model (meshrun.parallel.compile.whole_model_allows asks).
    compiles_whole = True

    def __init__(self, args: ModelArgs, *, seed: int | None = None):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: derived from args, so never in a checkpoint and cheap to rebuild.
        if torch.get_default_device().type == "meta":  # shapes only: init_weights computes them later
            cos, sin = (torch.empty(args.max_seq_len, args.head_dim // 2) for _ in range(2))
        else:
            cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)
        self.init_weights(seed)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the sequence positions of ``tokens``' columns, (T,) or per row (B, T)
        (default 0..T-1); under context parallel a rank holds two chunks of the sequence
        (meshrun.parallel.context), and a pipeline passes each micro-batch's rows.
        ``documents`` (B, T): packed examples (meshrun.data.packing.document_ids); attention stays
        inside each (a block-causal mask), None = causal over the whole row."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seqlen = h.shape[1]
        # (a simulated step's fake positions have no values to read: meshrun.train.simulate)
        last = seqlen if positions is None or is_fake(positions) else int(positions.max()) + 1
        if last > self.freqs_cos.shape[0]:
            raise ModelError(
                f"sequence length {last} exceeds model.max_seq_len={self.freqs_cos.shape[0]}; "
                "raise model.max_seq_len or shorten the sequences"
            )
        if positions is None:
            cos, sin = self.freqs_cos[:seqlen], self.freqs_sin[:seqlen]
        else:
            cos, sin = self.freqs_cos[positions], self.freqs_sin[positions]
        mask = None if documents is None else block_causal_mask(documents)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def reset_rope(self) -> None:
        """Recompute the RoPE tables in float32 on the buffers' device (after ``to_empty``)."""
        device = self.freqs_cos.device
        cos, sin = rope_tables(
            self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device
        )
        self.freqs_cos, self.freqs_sin = cos, sin

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would also round the RoPE angles; keep them float32.
        super()._apply(fn, recurse)
        if self.freqs_cos.dtype != torch.float32:
            self.reset_rope()
        return self

    def retie(self) -> None:
        """A tied head tied again after `to_empty` (what a fake build does instead of init_weights)."""
        retie_output(self)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Deterministic init; the same seed gives the same weights in every process and layout.

        Each weight is drawn on the CPU from its own generator, seeded by (seed, parameter name),
        then copied in. So the values do not depend on the device, on which blocks this pipeline
        stage holds, or on how tensor/FSDP parallel shards it (DTensor parameters receive their
        local shard of the same full tensor, without communication).

        Scheme (GPT-2 / torchtitan): truncated normal (+-3 std) with std 0.02; the projections
        that write into the residual stream (``wo``, ``w2``) and ``w3`` use torchtitan's depth init
        std 0.02 / sqrt(2 * (layer_id + 1)), so deeper blocks start smaller. Norm weights are 1.
        ``seed=None`` draws the seed from torch's default generator (follows ``torch.manual_seed``).
        Also recomputes the RoPE tables, so ``to_empty()`` + ``init_weights()`` completes a
        meta-device build.
        """
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        if self.freqs_cos.device.type != "meta":
            self.reset_rope()
        retie_output(self)  # a meta build's `to_empty` untied them
        std = 0.02
        if self.tok_embeddings is not None:
            _init("tok_embeddings.weight", self.tok_embeddings.weight, seed, std)
        for key, block in self.layers.items():
            depth_std = std / math.sqrt(2 * (block.layer_id + 1))
            prefix = f"layers.{key}."
            for name in ("wq", "wk", "wv", "wo"):
                _init(
                    f"{prefix}attention.{name}.weight",
                    getattr(block.attention, name).weight,
                    seed,
                    depth_std if name == "wo" else std,
                )
            if isinstance(block.feed_forward, MoE):
                # router gate and w1 at std, w2 and w3 (experts' and shared) at the depth std
                for name, param in block.feed_forward.named_parameters():
                    last = name.split(".")[-1] if not name.endswith(".weight") else name.split(".")[-2]
                    _init(f"{prefix}feed_forward.{name}", param, seed,
                          depth_std if last in ("w2", "w3") else std)
                block.feed_forward.reset_buffers()
            else:
                for name in ("w1", "w2", "w3"):
                    _init(
                        f"{prefix}feed_forward.{name}.weight",
                        getattr(block.feed_forward, name).weight,
                        seed,
                        std if name == "w1" else depth_std,
                    )
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            if not self.args.tie_embeddings:
                _init("output.weight", self.output.weight, seed, std)
            elif (
                self.tok_embeddings is None or self.output.weight is not self.tok_embeddings.weight
            ):
                # A last pipeline stage holds its own copy of the tied matrix: same values.
                _init("tok_embeddings.weight", self.output.weight, seed, std)


def _init(name: str, param: torch.Tensor, seed: int, std: float) -> None:
    """Fill ``param`` with trunc_normal(0, std, +-3 std) from a generator keyed by (seed, name)."""
    if param.device.type == "meta":
        return
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    full = torch.empty(param.shape, dtype=torch.float32)
    nn.init.trunc_normal_(full, 0.0, std, -3 * std, 3 * std, generator=gen)
    param.copy_(_like(full, param))


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` as the same kind of tensor as ``param`` (a DTensor gets its local shard)."""
    # Only look for DTensor when something already imported it: the import costs seconds.
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full tensor, so shard locally.
            full = full.to(device=param.device, dtype=param.dtype)
            return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full.to(device=param.device, dtype=param.dtype)


def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once; DTensors by global size).

    ``exclude_embeddings`` leaves out the weights of ``nn.Embedding`` modules (the token
    embedding, and with it a tied output projection), as in Kaplan et al. (arXiv:2001.08361).
    """
    skip = set()
    if exclude_embeddings:
        skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)
