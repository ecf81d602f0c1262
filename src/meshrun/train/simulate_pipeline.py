"""A simulated rank's pipeline: torch's schedule started without its peers (`meshrun.train.simulate`).

Under the fake process group a receive brings nothing, and a schedule's first step needs two
things from its peers: their vote on how to infer the stages' shapes (point-to-point, read with
`.item()`), and the shapes themselves (pickled objects). `without_p2p_metadata` answers for the
peers; `stage_boundary` gives what a stage sends, from a probe of the first stage. Private names of
`torch.distributed.pipelining` (torch 2.13) are used here, and only here: the real launch never
runs this, and tests/distributed/test_simulate.py compares the simulated pipelines with real ones.
"""

from __future__ import annotations

import torch
from torch import nn

from meshrun.parallel.resolve import ResolvedLayout


def module_hooks_allowed(layout: ResolvedLayout) -> bool:
    """Whether torch's MemTracker may hook the modules of a step of `layout` (`PeakMemory`): not
    under the zero-bubble schedules, whose input-gradient pass is an `autograd.grad` that the
    module hooks make torch refuse ("A leaf node was passed to _will_engine_execute_node", torch
    2.13, real and fake tensors alike). Their peak is measured without them."""
    from meshrun.parallel.rules_pp import ZERO_BUBBLE

    return layout.pipeline is None or layout.pipeline.schedule not in ZERO_BUBBLE


def stage_boundary(probe: nn.Module, built, tokens: torch.Tensor, dtype: str) -> tuple:
    """What a pipeline stage sends the next one for a micro-batch, as torch's schedule describes
    it (`_TensorMeta`s): the first stage's output without its blocks (each block keeps the shape
    and dtype of what it is given), from a probe made as the stages were (tp, fsdp, precision)
    and run on a micro-batch of this rank's share of the sequence (context parallel's)."""
    from torch.distributed.pipelining._utils import extract_tensor_metas

    from meshrun.train.precision import autocast_context

    pipeline = built.pipeline
    cp = built.context_parallel.degree if built.context_parallel is not None else 1
    micro_batch = tokens[: max(1, tokens.shape[0] // pipeline.plan.microbatches), : tokens.shape[1] // cp]
    with autocast_context(built.device, dtype):  # with autograd: whether the output requires grad is its shape too
        return extract_tensor_metas((probe(micro_batch),))


def without_p2p_metadata(pipeline, boundary: tuple) -> None:
    """Let torch's schedule start without its peers: under the fake process group a receive
    brings nothing, and the schedule's first step receives its peers' vote on how to infer shapes
    (P2P, then `.item()`) and the shapes themselves (pickled objects). Here each stage votes for
    inference (`InferenceMode.DYNAMIC`, what the real vote gives when no stage was given shapes),
    is handed `boundary` as what the previous stage sends, and the gradient of its own output as
    what the next one sends back. Only the first step does this; the step measured after it runs
    the schedule as torch wrote it (its activation and gradient sends and receives counted).
    Private names of torch.distributed.pipelining (2.13): checked by tests/distributed/test_simulate.py."""
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _derive_grad_metas,
        _StageBackwardMeta,
        _StageForwardMeta,
    )

    def vote(stages, has_backward, p2p_done) -> None:  # noqa: ANN001 - torch's signature
        for stage in stages:
            stage._inference_mode = InferenceMode.DYNAMIC

    pipeline.schedule._warmup_p2p = vote
    for stage in pipeline.stages:
        def receive(peer: int, stage=stage):  # noqa: ANN001, ANN202
            if peer < stage.stage_index:
                return _StageForwardMeta(forward_metas=boundary)
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(stage._stage_meta.outputs))

        stage._recv_meta = receive
        stage._send_meta = lambda meta, peer: None
