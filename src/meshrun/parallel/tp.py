"""Tensor parallel for the built-in Transformer: Megatron-style column/row splits via DTensor.

Technique: Megatron-LM (Shoeybi et al., arXiv:1909.08053): in each block the first matmul of a
pair is split by output columns (each rank keeps whole heads / a slice of the FFN width) and the
second by input rows, so one all-reduce per pair restores the full activation. Sequence
parallel (Korthikanti et al., arXiv:2205.05198) also splits the norms' activations along the
sequence, turning each all-reduce into a reduce-scatter plus an all-gather. The plans follow
torchtitan's `apply_tp` (torchtitan/models/llama3/infra/parallelize.py) and the torch TP
tutorial (https://docs.pytorch.org/tutorials/intermediate/TP_tutorial.html).

Differences from torchtitan, and why:
- Under sequence parallel the residual stream stays a DTensor (`use_local_output=False` on the
  layers that produce it). The built-in model slices its RoPE tables by `h.shape[1]` after the
  embedding; a DTensor reports the global sequence length there, a local shard would not.
- A tied embedding/output matrix cannot be row-split and column-split at once, so with
  `tie_embeddings` both stay replicated (plain tensors, identical gradients on every tp rank),
  and sequence/loss parallel are refused.

On CPU/gloo every plan here runs and matches one process (tests/distributed/test_parallel_fsdp_tp.py).
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshrun.errors import ModelError

logger = logging.getLogger(__name__)

BLOCK_MODULES = ("attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "ffn_norm", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
DENSE_FFN = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> nn.Module:
    """Split `model`'s linear layers over the 1-D `tp_mesh`, in place; returns `model`.

    sequence_parallel: norms and the residual stream sharded along the sequence (dim 1).
    loss_parallel: the logits stay sharded over the vocabulary (a DTensor, Shard(-1)); the loss
    and its backward must then run under `torch.distributed.tensor.parallel.loss_parallel()`.
    Without it the logits are all-gathered into a plain tensor and any loss works.
    A model with a `tp_block_plan(sequence_parallel)` method (the HF adapter) gives its own
    per-block plan; otherwise the built-in one (names in BLOCK_MODULES) applies, and a model
    without those names gets a ModelError.

    A mixture-of-experts block (its feed-forward routes tokens to grouped experts, meshrun.models.moe)
    splits its attention only: the router, the routed experts and the shared experts stay whole on
    every tp rank, which all see the same tokens (the attention's output is all-reduced, or
    all-gathered under sequence parallel), so they compute and get the same gradients there, as
    one process; expert parallel shards the routed experts over its own ep ranks, which never
    include two ranks of one tp group. Only the dense parts are tensor parallel.
    """
    own_plan = getattr(model, "tp_block_plan", None)  # a model's own block plan (models.hf)
    _check_layout(model, blocks=own_plan is None)
    parallelize_module(model, tp_mesh, _root_plan(model, sequence_parallel, loss_parallel))
    for block in _blocks(model):
        block = _unwrapped(block)
        plan = (own_plan(sequence_parallel) if own_plan is not None
                else _block_plan(sequence_parallel, dense_ffn=not _routes_tokens(block)))
        parallelize_module(block, tp_mesh, plan)
    return model


def _routes_tokens(block: nn.Module) -> bool:
    """Whether `block`'s feed-forward is a mixture of experts (it holds routed grouped experts)."""
    experts = getattr(getattr(block, "feed_forward", None), "experts", None)
    return bool(getattr(experts, "routed_by_counts", False))


def _root_plan(model: nn.Module, sp: bool, loss_parallel: bool) -> dict:
    """Embedding rowwise (vocab rows split), final norm, output colwise (vocab columns split)."""
    plan: dict = {}
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    if tied:
        # One matrix cannot be split by rows (embedding) and by columns (output) at once: keep it
        # whole. Sequence parallel would then need the embedding's output re-sharded, and loss
        # parallel a split output layer; neither is offered for tied weights.
        if sp or loss_parallel:
            raise ModelError("tensor parallel with model.tie_embeddings=true keeps the shared matrix "
                             "replicated; turn sequence/loss parallel off or set model.tie_embeddings=false")
        logger.info("tie_embeddings: the shared embedding/output matrix stays replicated under TP")
        return plan
    if model.tok_embeddings is not None:
        # Rowwise on an embedding splits the vocabulary; ids outside a rank's rows give zeros and
        # the partial results are summed (reduce-scattered along the sequence under SP).
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(),
            output_layouts=Shard(1) if sp else Replicate(),
            use_local_output=not sp,
        )
    if sp and model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def _block_plan(sp: bool, dense_ffn: bool = True) -> dict:
    """wq/wk/wv and w1/w3 colwise (whole heads / FFN slices per rank), wo and w2 rowwise; with
    `dense_ffn` False (a mixture of experts) the feed-forward stays whole (see apply_tp)."""
    plan: dict = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate(),
                                        use_local_output=not sp),
    }
    if dense_ffn:
        plan.update({
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate(),
                                               use_local_output=not sp),
        })
    if sp:
        plan.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # Gather the sequence before the projections; RoPE's cos/sin (plain tensors) pass through.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None),
                                            use_local_output=True),
            # A whole (mixture-of-experts) feed-forward gives every tp rank's output in full: its
            # local part of the sequence goes on in the residual stream, with no communication.
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),),
                                               use_local_output=True) if dense_ffn else
            PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                     use_local_input=True, output_layouts=(Replicate(),),
                                     desired_output_layouts=(Shard(1),), use_local_output=False),
        })
    return plan


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def _unwrapped(block: nn.Module) -> nn.Module:
    """The block inside an activation-checkpoint wrapper (TP is meant to come first, but be lenient)."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def _check_layout(model: nn.Module, *, blocks: bool = True) -> None:
    for attr in ("layers", "tok_embeddings", "norm", "output"):
        if not hasattr(model, attr):
            raise ModelError(f"tensor parallel needs the built-in Transformer layout; "
                             f"{type(model).__name__} has no `{attr}` (see meshrun.models.llama)")
    if not blocks:
        return
    for index, block in enumerate(_blocks(model)):
        for name in BLOCK_MODULES if not _routes_tokens(_unwrapped(block)) else set(BLOCK_MODULES) - set(DENSE_FFN):
            try:
                _unwrapped(block).get_submodule(name)
            except AttributeError:
                raise ModelError(f"tensor parallel needs the built-in block layout; block {index} "
                                 f"of model.layers has no `{name}`") from None
