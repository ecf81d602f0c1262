"""Context parallel: each sequence split over the cp ranks, attention computed as a ring.

    cp = ContextParallel(mesh["cp"])                  # meshrun.parallel.layout builds it when cp > 1
    with cp.step(inputs, targets) as (inputs, targets, positions):   # this rank's tokens
        logits = model(inputs, positions=positions)    # RoPE at the tokens' own positions
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()                                # in the context too: the ring's backward

Technique: ring attention (Liu et al., arXiv:2310.01889): each rank keeps its queries while the
keys and values go round the cp ranks, and the partial results are merged by their log-sum-exp.
With a causal mask, rank r holds chunks r and 2*cp-1-r of the sequence cut into 2*cp (head-tail
load balancing), so every rank has as much of the mask to compute. The ring is torch's own
(torch/distributed/tensor/experimental/_context_parallel/_attention.py); nothing here writes one.

One interface, two backends:
- An accelerator: torch's public `torch.distributed.tensor.experimental.context_parallel`. It
  shards the batch and the positions head-tail in place, replaces
  `F.scaled_dot_product_attention` inside the context and runs the flash, efficient or cuDNN
  kernel as a ring through DTensor.
- CPU: that API fails on torch 2.13 (`aten._scaled_dot_product_flash_attention_for_cpu` has no
  sharding strategy registered, and the handler maps only the CUDA kernels).
  Here torch's ring functions (`_templated_ring_attention` and its backward) run around
  `aten._scaled_dot_product_flash_attention_for_cpu` and its backward in an `autograd.Function`;
  the split is the same head-tail order (`head_tail_indices`), and F.scaled_dot_product_attention
  is replaced inside `step` only and restored after it, as the public API does.

The private names are listed in PRIVATE_NAMES and looked up only when a CPU step runs; if torch
moves one, the step stops with one line naming it and the torch version (tests/unit/
test_context_parallel.py pins them). Causal attention without a mask or dropout is the only kind
offered (the built-in model's, and a Hugging Face model's through `models.hf.cp_attention`;
grouped-query heads are repeated as SDPA's `enable_gqa` does); anything else is refused in one line.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from meshrun.errors import MeshrunError, ModelError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

RING_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"
PRIVATE_NAMES = ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options")
"""What the CPU backend takes from RING_MODULE (private in torch 2.13: pinned by a test)."""
CPU_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
"""The aten kernels the ring runs on CPU: forward (output, logsumexp) and backward (dq, dk, dv)."""
SEQ_DIM = 2  # of q, k, v: (batch, heads, sequence, head_dim)


def head_tail_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions cp rank `rank` holds: chunk `rank` and chunk `2*cp-1-rank` of 2*cp equal chunks.

    The order torch's ring assumes under load balancing (its `_HeadTailLoadBalancer`); seq_len
    must divide by 2*cp (meshrun.parallel.rules.check_context_parallel says so up front).
    """
    assert seq_len % (2 * cp) == 0, (seq_len, cp)
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([head, tail])


def torch_ring() -> Any:
    """torch's ring-attention module, with every name of PRIVATE_NAMES and CPU_OPS present, or one line."""
    version = torch.__version__
    try:
        module = importlib.import_module(RING_MODULE)
    except ImportError:
        module = None
    missing = [name for name in PRIVATE_NAMES if not hasattr(module, name)]
    missing += [f"aten.{op}" for op in CPU_OPS if not hasattr(torch.ops.aten, op)]
    if missing:
        raise MeshrunError(f"context parallel on CPU uses torch's ring attention, but torch {version} has no "
                           f"{', '.join(missing)} (in {RING_MODULE}); use torch 2.13 or parallel.cp=1")
    return module


@contextlib.contextmanager
def _head_tail(ring: Any) -> Iterator[None]:
    """torch's ring reads the process-wide `_cp_options.enable_load_balance` (True by default; its
    public API sets and restores it): on for our head-tail split, whatever it was, then as it was."""
    options = ring._cp_options
    before = options.enable_load_balance
    options.enable_load_balance = True
    try:
        yield
    finally:
        options.enable_load_balance = before


class _RingAttention(torch.autograd.Function):
    """Causal attention over the cp ring on CPU: torch's ring around the CPU flash kernel."""

    @staticmethod
    def forward(ctx, query, key, value, group, scale):  # noqa: ANN001 - autograd's signature
        ring = torch_ring()
        with _head_tail(ring):
            out, lse = ring._templated_ring_attention(
                group, SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                query, key, value, is_causal=True, dropout_p=0.0, scale=scale)[:2]
        # (batch, seq, heads, head_dim) in memory, as the CPU flash kernel lays out its own output:
        # the caller's transpose(1, 2).reshape is then a view, and `wo` saves this same storage
        # instead of a copy (one h-wide activation per token and block less).
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        query, key, value, out, lse = ctx.saved_tensors
        ring = torch_ring()
        with _head_tail(ring):
            grads = ring._templated_ring_attention_backward(
                ctx.group, SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                grad_out.contiguous(), "grad_out", query, key, value, out, lse, is_causal=True,
                dropout_p=0.0, scale=ctx.scale)
        return grads[0], grads[1], grads[2], None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group, *,
                   scale: float | None = None) -> torch.Tensor:
    """Causal SDPA of this rank's queries against every cp rank's keys and values (CPU backend).

    query, key, value: (batch, heads, local sequence, head_dim), this rank's head-tail tokens.
    """
    return _RingAttention.apply(query, key, value, group, scale)


def _cpu_sdpa(group):
    """F.scaled_dot_product_attention's signature, answered by the ring (causal only)."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):  # noqa: ANN001 - torch's signature
        if attn_mask is not None or not is_causal or dropout_p:
            raise ModelError("context parallel (parallel.cp > 1) runs causal attention only: "
                             "scaled_dot_product_attention(is_causal=True) without attn_mask or dropout_p; "
                             "this model asks for more, so set parallel.cp=1")
        if enable_gqa and key.shape[1] != query.shape[1]:
            # grouped-query attention: each key/value head serves heads/kv_heads query heads,
            # as SDPA's enable_gqa computes it (the CPU flash kernel takes equal head counts)
            repeats = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        return ring_attention(query, key, value, group, scale=scale)

    return sdpa


def check_model(model: torch.nn.Module, cp: int) -> None:
    """A model split by sequence must take the positions of its tokens (`forward(tokens, positions=)`,
    as the built-in Transformer and the Hugging Face adapter do): without them its RoPE would count
    from 0 on every rank. A model with `enable_context_parallel(cp)` (the Hugging Face adapter)
    is asked to route its attention where the ring replaces it, or to refuse in one line."""
    import inspect

    forward = getattr(model, "forward", None)
    try:
        takes = forward is not None and "positions" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        raise ModelError(f"parallel.cp={cp} splits each sequence, but {type(model).__name__}.forward takes no "
                         "positions= argument for its tokens' places in the sequence (the built-in model "
                         "does); set parallel.cp=1")
    enable = getattr(model, "enable_context_parallel", None)
    if callable(enable):
        enable(cp)


class ContextParallel:
    """This rank's place on the 1-D cp mesh: splits batches along the sequence, runs attention as a ring."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.degree = mesh.size()
        self.rank = mesh.get_local_rank()
        self.cpu = mesh.device_type == "cpu"

    def positions(self, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """This rank's token positions in a sequence of `seq_len` (head-tail order)."""
        return head_tail_indices(seq_len, self.degree, self.rank).to(device)

    def split(self, *tensors: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, ...]:
        """This rank's head-tail share of each tensor along `dim` (all of one sequence length)."""
        index = self.positions(tensors[0].shape[dim], tensors[0].device)
        return tuple(t.index_select(dim, index) for t in tensors)

    @contextlib.contextmanager
    def step(self, inputs: torch.Tensor, targets: torch.Tensor
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(inputs, targets, positions) of this rank's tokens; attention is the ring inside.

        Run forward, loss and backward inside: the backward rotates keys, values and their
        gradients round the ring as well. Every cp rank of a data-parallel rank enters it with the
        same batch.
        """
        seq_len = inputs.shape[1]
        if self.cpu:
            with self._cpu_attention():
                yield (*self.split(inputs, targets), self.positions(seq_len, inputs.device))
            return
        from torch.distributed.tensor.experimental import context_parallel

        buffers = [inputs.clone(), targets.clone(), torch.arange(seq_len, device=inputs.device)]
        with context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers=set(buffers)):
            yield buffers[0], buffers[1], buffers[2]

    @contextlib.contextmanager
    def _cpu_attention(self) -> Iterator[None]:
        """F.scaled_dot_product_attention is the ring until the context ends, then torch's again."""
        torch_ring()  # a moved private name: one line before anything is replaced
        original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _cpu_sdpa(self.mesh.get_group())
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original
