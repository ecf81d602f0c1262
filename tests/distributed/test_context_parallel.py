"""Context parallel on 2 gloo ranks: torch's ring attention on CPU equals full-sequence SDPA, and
the trainer's path (build_layout -> layout_step / layout_evaluate) with parallel.cp = 2 trains
like one process; a DCP checkpoint written under cp 2 resumes under FSDP 2 (another layout).

One 2-rank run does all three. The ring: causal attention of random q, k, v (batch 2, 4 heads,
seq 16, head_dim 8), each rank holding its head-tail quarter pair; its output and dq, dk, dv
must equal `F.scaled_dot_product_attention` over the whole sequence within 1e-6. Training: the
tiny built-in decoder (dim 32, 2 blocks, GQA 4/2 heads, vocab 64, seq 16), fp32, AdamW, 10
steps with clipping that clips, one fixed global batch: the loss every rank logs, the grad norm
and the eval loss within 1e-4 of a single process (the 4-rank layouts, cp x fsdp, cp 4 and
cp x tp, are in tests/e2e/test_parallel_matrix.py). The 4-way ring is exercised there (cp4).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshrun.config.sections import ParallelSection, TrainSection
from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.layout import build_layout
from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
from meshrun.testing import run_distributed
from meshrun.train.step import layout_evaluate, layout_mean_loss, layout_step

pytestmark = pytest.mark.timeout(120)

SEQ = 16
GLOBAL_BATCH = 4
STEPS = 10
RESUME_AT = 5  # the cp 2 run saves here; the FSDP 2 run resumes from it
MAX_NORM = 0.5
TOL = 1e-4
ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
TRAIN = TrainSection(batch_size=GLOBAL_BATCH, seed=7)
CPU = torch.device("cpu")


def _ring_vs_sdpa() -> dict[str, float]:
    """On each rank: the ring over this rank's head-tail share against full SDPA's same rows."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshrun.parallel.context import ContextParallel, ring_attention

    gen = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(2, 4, SEQ, 8, generator=gen) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    want.backward(grad)
    cp = ContextParallel(init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",)))
    local = [t.clone().requires_grad_() for t in cp.split(q, k, v, dim=2)]
    got = ring_attention(*local, cp.mesh.get_group())
    got.backward(*cp.split(grad, dim=2))
    pairs = {"out": (got, want), **{f"d{n}": (t.grad, f.grad) for n, t, f in zip("qkv", local, full, strict=True)}}
    return {name: (a - cp.split(b, dim=2)[0]).abs().max().item() for name, (a, b) in pairs.items()}


def _batches(dp_rank: int, dp_size: int, seed: int = 1000):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    per = GLOBAL_BATCH // dp_size
    return itertools.repeat((tokens[dp_rank * per:(dp_rank + 1) * per, :-1], tokens[dp_rank * per:(dp_rank + 1) * per, 1:]))


def _layout(parallel: ParallelSection, world_size: int):
    with torch.device("meta"):
        model = Transformer(ARGS)
    options = ParallelOptions.from_sections(parallel, TRAIN)
    resolved = resolve_layout(options, world_size, ModelShape.from_model(model))
    layout = build_layout(model, resolved, device=CPU, seed=7)
    return layout, [torch.optim.AdamW(layout.parts[0].parameters(), lr=1e-2, weight_decay=0.1)]


def _steps(layout, optimizers, steps: int) -> tuple[list[float], list[float]]:
    batches = _batches(layout.dp_rank, layout.dp_size)
    losses, norms = [], []
    for _ in range(steps):
        loss, norm, _ = layout_step(layout, optimizers, batches, grad_accum=1, dtype="fp32", grad_clip=MAX_NORM)
        losses.append(layout_mean_loss(layout, loss))
        norms.append(float(norm))
    return losses, norms


def _train(parallel: ParallelSection, world_size: int, steps: int = STEPS) -> dict:
    layout, optimizers = _layout(parallel, world_size)
    losses, norms = _steps(layout, optimizers, steps)
    val = layout_evaluate(layout, _batches(layout.dp_rank, layout.dp_size, seed=2000), steps=1, dtype="fp32")
    return {"losses": losses, "norms": norms, "eval": val}


def _resume_across_layouts(root: str) -> dict:
    """cp 2 trains RESUME_AT steps and saves (DCP); FSDP 2 loads it and trains the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    layout, optimizers = _layout(ParallelSection(strategy="fsdp", dp_replicate=1, dp_shard=1, cp=2), 2)
    first, _ = _steps(layout, optimizers, RESUME_AT)
    model_state, optim_state = get_state_dict(layout.parts[0], optimizers)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=root)
    layout, optimizers = _layout(ParallelSection(strategy="fsdp", dp_replicate=1, dp_shard=2), 2)
    model_state, optim_state = get_state_dict(layout.parts[0], optimizers)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(layout.parts[0], optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rest, _ = _steps(layout, optimizers, STEPS - RESUME_AT)
    return {"losses": first + rest}


def _rank_all(root: str) -> dict:
    cp2 = ParallelSection(strategy="fsdp", dp_replicate=1, dp_shard=1, cp=2)
    return {"ring": _ring_vs_sdpa(), "cp2": _train(cp2, 2), "resumed": _resume_across_layouts(root)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("cp_ckpt"))
    return run_distributed(_rank_all, world_size=2, args=(root,), timeout=100)


@pytest.fixture(scope="module")
def reference() -> dict:
    return _train(ParallelSection(), 1)


def test_ring_attention_matches_full_sequence_sdpa(runs):
    for rank, result in enumerate(runs):
        assert max(result["ring"].values()) < 1e-6, (rank, result["ring"])


def test_cp2_trains_like_one_process(runs, reference):
    ref = torch.tensor(reference["losses"])
    assert ref[-1] < ref[0] - 0.5 and reference["norms"][0] > MAX_NORM, reference  # learns, clips
    for rank, result in enumerate(runs):
        got = result["cp2"]
        diff = (torch.tensor(got["losses"]) - ref).abs().max().item()
        norm_diff = (torch.tensor(got["norms"]) - torch.tensor(reference["norms"])).abs().max().item()
        assert diff < TOL and norm_diff < TOL, (rank, diff, norm_diff, got)
        assert abs(got["eval"] - reference["eval"]) < TOL, (rank, got["eval"], reference["eval"])


def test_a_cp2_checkpoint_resumes_under_fsdp2(runs, reference):
    ref = torch.tensor(reference["losses"])
    for rank, result in enumerate(runs):
        got = torch.tensor(result["resumed"]["losses"])
        assert (got - ref).abs().max().item() < TOL, (rank, got.tolist(), ref.tolist())
