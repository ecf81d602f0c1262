"""Masked (chat) data on 2 real gloo ranks with grad_accum 2 trains like one process on the same
global batch: the loss is averaged over the trained tokens of the whole global batch.

The batch is built so that the trained targets fall unevenly: rank 0's rows train many targets and
rank 1's few, and within a rank the two micro-batches differ too, so a mean of per-rank or
per-micro-batch means (the "loss over micro-batches" bug) would differ from one process by far
more than the tolerance. Each layout runs meshrun's own `layout_step` (masked=True) for 4 SGD
steps; its dp-averaged loss and grad norm must match one process (grad_accum 1, the whole batch)
within 1e-4 at every step, and so must the held-out loss of the batch after them (not under pp,
whose evaluation averages the schedule's micro-batches). Layouts: ddp 2, fsdp 2, tp 2 with loss
parallel, cp 2, pp 2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.context import ContextParallel
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.layout import BuiltLayout
from meshrun.parallel.parallelize import parallelize_nd, parallelize_pipeline
from meshrun.parallel.pipeline import resolve_pipeline
from meshrun.testing import run_distributed
from meshrun.train.step import IGNORE_INDEX, layout_evaluate, layout_mean_loss, layout_step

pytestmark = pytest.mark.timeout(90)

STEPS = 4
GLOBAL_BATCH = 8
SEQ = 16
TOL = 1e-4
CPU = torch.device("cpu")
LAYOUTS = {  # name -> degrees, loss_parallel
    "ddp2": (dict(dp_replicate=2), False),
    "fsdp2": (dict(dp_shard=2), False),
    "tp2_loss_parallel": (dict(tp=2), True),
    "cp2": (dict(cp=2), False),
    "pp2": (dict(pp=2), False),  # the schedule's loss: 2 micro-batches of the schedule per accumulation step
}


def _args() -> ModelArgs:
    return ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=SEQ)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 0-3 (rank 0 under dp 2) train 14, 12, 3 and 1 targets; rows 4-7 one target each, or none."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    trained = [14, 12, 3, 1, 1, 0, 1, 1]
    for row, n in enumerate(trained):
        targets[row, : SEQ - n] = IGNORE_INDEX  # the tail is the "assistant" answer
    return inputs, targets


def _train(degrees: dict | None = None, loss_parallel: bool = False, *, old_mean: bool = False) -> dict:
    model = Transformer(_args(), seed=7)
    layout = BuiltLayout([model], dp_rank=0, dp_size=1, device=CPU)
    accum = 1
    if degrees is not None:
        world = dist.get_world_size()
        dims = ParallelDims(**{"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **degrees}, world_size=world)
        mesh = dims.build_mesh("cpu")
        accum, pipeline = 2, None
        if dims.pp_enabled:
            plan = resolve_pipeline(pp=dims.pp, schedule="gpipe", stages_per_rank=0, split_points="", n_layers=2,
                                    batch_size=GLOBAL_BATCH // dims.dp_size // accum, microbatches=0,
                                    dp_size=dims.dp_size)
            pipeline = parallelize_pipeline(model, dims, mesh, plan, device=CPU, grad_accum=accum)
            parts = pipeline.parts
        else:
            parts = [parallelize_nd(model, dims, mesh, device=CPU, loss_parallel=loss_parallel)]
        layout = BuiltLayout(parts, dp_rank=dims.dp_rank(mesh), dp_size=dims.dp_size, device=CPU,
                             world_size=world, dims=dims, mesh=mesh, loss_parallel=loss_parallel, pipeline=pipeline,
                             context_parallel=ContextParallel(mesh["cp"]) if dims.cp_enabled else None)
    accum = 4 if old_mean else accum
    optimizers = [torch.optim.SGD(part.parameters(), lr=0.5) for part in layout.parts]
    inputs, targets = _batch()
    per_rank = GLOBAL_BATCH // layout.dp_size
    rows = range(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)
    micro = per_rank // accum
    out = {"losses": [], "norms": []}
    for _ in range(STEPS):
        batches = iter([(inputs[rows.start + i * micro: rows.start + (i + 1) * micro],
                         targets[rows.start + i * micro: rows.start + (i + 1) * micro]) for i in range(accum)])
        loss, norm, _ = layout_step(layout, optimizers, batches, grad_accum=accum, dtype="fp32", grad_clip=0.0,
                                    masked=not old_mean)
        out["losses"].append(layout_mean_loss(layout, loss))
        out["norms"].append(float(norm))
    if layout.pipeline is None:  # held-out loss: over the trained targets of every rank's rows
        out["eval"] = layout_evaluate(layout, [(inputs[rows], targets[rows])], steps=1, dtype="fp32", masked=True)
    return out


def _rank_layouts() -> dict[str, dict]:
    return {name: _train(degrees, lp) for name, (degrees, lp) in LAYOUTS.items()}


def test_masked_loss_under_ddp_fsdp_tp_cp_pp_with_grad_accum_matches_one_process():
    ranks = run_distributed(_rank_layouts, world_size=2, timeout=60)
    ref = _train()
    # the old averaging (each micro-batch's mean / grad_accum, 4 micro-batches of 2 rows) on one
    # process: far from the reference, so the check bites
    old = _train(old_mean=True)
    assert max(abs(a - b) for a, b in zip(old["norms"] + old["losses"], ref["norms"] + ref["losses"],
                                          strict=True)) > 50 * TOL
    for name in LAYOUTS:
        for rank, got in enumerate(ranks):
            assert got[name]["losses"] == pytest.approx(ref["losses"], abs=TOL), f"{name} rank {rank}"
            assert got[name]["norms"] == pytest.approx(ref["norms"], abs=TOL), f"{name} rank {rank}"
            assert got[name].get("eval", ref["eval"]) == pytest.approx(ref["eval"], abs=TOL), f"{name} rank {rank}"
    assert ref["losses"][-1] < ref["losses"][0], "the reference did not learn"
