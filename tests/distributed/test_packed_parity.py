"""Packed examples (data.packing) on 2 real gloo ranks train like one process on the same global batch.

The rows are packed sequences of a length-skewed set of examples (meshrun.data.packing), so every
row holds several examples, padding, and a different number of trained targets. Each layout runs
meshrun's own `layout_step` (masked: the loss averaged over the global batch's trained targets)
with grad_accum 2 for 3 SGD steps; its dp-averaged loss and grad norm must match one process
(grad_accum 1, the whole batch) within 1e-5 at every step, and so must the held-out loss after them
(not under pp). The reference run without the examples' documents (attention across them) differs
by far more, so a layout that dropped the mask on the way (a pipeline stage, a TP shard) fails.
Layouts: ddp 2, tp 2 with sequence parallel and activation checkpointing (heads sharded, the mask
broadcast over them, passed by keyword past TP's input plan and the checkpoint wrapper), pp 2 (the
examples' documents travel to every stage with each micro-batch).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshrun.data.packing import PackedExampleDataset
from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.layout import BuiltLayout
from meshrun.parallel.parallelize import parallelize_nd, parallelize_pipeline
from meshrun.parallel.pipeline import resolve_pipeline
from meshrun.testing import run_distributed
from meshrun.train.step import layout_evaluate, layout_mean_loss, layout_step

pytestmark = pytest.mark.timeout(90)

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 16
TOL = 1e-5
CPU = torch.device("cpu")
LAYOUTS = {  # name -> degrees, parallelize_nd options
    "ddp2": (dict(dp_replicate=2), {}),
    "tp2_sp_ac": (dict(tp=2), dict(sequence_parallel=True, activation_checkpointing=True)),
    "pp2": (dict(pp=2), {}),
}


def _args() -> ModelArgs:
    return ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=SEQ)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8 packed rows of a skewed set: mostly 3-6 token examples, some of 12-17; the first half of
    each example is its prompt (untrained)."""
    gen = torch.Generator().manual_seed(3)
    lengths = [int(n) for n in torch.randint(3, 7, (40,), generator=gen)]
    for i in range(0, 40, 7):
        lengths[i] = int(torch.randint(12, SEQ + 2, (1,), generator=gen))
    bounds = torch.tensor([0] + lengths).cumsum(0)
    tokens = torch.randint(0, 64, (int(bounds[-1]),), generator=gen)
    mask = torch.ones(len(tokens), dtype=torch.uint8)
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        mask[start : start + (end - start) // 2] = 0
    ds = PackedExampleDataset(tokens, mask, bounds, SEQ)
    assert len(ds) >= GLOBAL_BATCH
    return tuple(torch.stack(col) for col in zip(*(ds[i] for i in range(GLOBAL_BATCH)), strict=True))


def _train(degrees: dict | None = None, options: dict | None = None, *, unmasked: bool = False) -> dict:
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
            parts = [parallelize_nd(model, dims, mesh, device=CPU, **(options or {}))]
        layout = BuiltLayout(parts, dp_rank=dims.dp_rank(mesh), dp_size=dims.dp_size, device=CPU,
                             world_size=world, dims=dims, mesh=mesh, pipeline=pipeline)
    optimizers = [torch.optim.SGD(part.parameters(), lr=0.5) for part in layout.parts]
    batch = _batch()
    if unmasked:  # positions 0..T-1: one causal row, attention across the packed examples
        batch = batch[:2]
    per_rank = GLOBAL_BATCH // layout.dp_size
    rows = slice(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)
    micro = per_rank // accum
    out = {"losses": [], "norms": []}
    for _ in range(STEPS):
        batches = iter([tuple(t[rows][i * micro : (i + 1) * micro] for t in batch) for i in range(accum)])
        loss, norm, _ = layout_step(layout, optimizers, batches, grad_accum=accum, dtype="fp32", grad_clip=0.0,
                                    masked=True)
        out["losses"].append(layout_mean_loss(layout, loss))
        out["norms"].append(float(norm))
    if layout.pipeline is None:
        out["eval"] = layout_evaluate(layout, [tuple(t[rows] for t in batch)], steps=1, dtype="fp32", masked=True)
    return out


def _rank_layouts() -> dict[str, dict]:
    return {name: _train(degrees, options) for name, (degrees, options) in LAYOUTS.items()}


def test_packed_examples_under_ddp_tp_sp_pp_with_grad_accum_match_one_process():
    ranks = run_distributed(_rank_layouts, world_size=2, timeout=60)
    ref = _train()
    leaky = _train(unmasked=True)
    assert max(abs(a - b) for a, b in zip(leaky["losses"] + leaky["norms"], ref["losses"] + ref["norms"],
                                          strict=True)) > 100 * TOL
    for name in LAYOUTS:
        for rank, got in enumerate(ranks):
            assert got[name]["losses"] == pytest.approx(ref["losses"], abs=TOL), f"{name} rank {rank}"
            assert got[name]["norms"] == pytest.approx(ref["norms"], abs=TOL), f"{name} rank {rank}"
            assert got[name].get("eval", ref["eval"]) == pytest.approx(ref["eval"], abs=TOL), f"{name} rank {rank}"
    assert ref["losses"][-1] < ref["losses"][0], "the reference did not learn"
