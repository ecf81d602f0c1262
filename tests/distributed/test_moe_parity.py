"""tiny-moe on 2 real gloo ranks trains like one process: FSDP and DDP, bias and balance loss.

Each layout trains tiny-moe's shapes (4 experts, top 2, 1 shared, MoE in every block; vocab 64,
seq 16) for 10 AdamW steps on one fixed global batch of 8 sequences, through meshrun's
own step (train_step, the trainer's loss average) and the trainer's after-step MoE bookkeeping
(MoEStats: the load summed over the ranks by an all-reduce, then the DeepSeek-V3 bias update,
with a bias rate high enough that the bias moves the routing within 10 steps). Against a
single-process run of the same code, the dp-averaged loss and the clipped grad norm must match
at every step within 1e-4, the logged MoE figures too (the same on every rank), and the final
expert biases exactly. One 2-rank launch trains every layout in turn.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshrun.models.llama import ModelArgs, Transformer
from meshrun.models.moe import MoE
from meshrun.models.sizes import size_spec
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.parallelize import parallelize_nd
from meshrun.testing import run_distributed
from meshrun.train.moe_stats import MoEStats
from meshrun.train.step import mean_loss_across_ranks, train_step

pytestmark = pytest.mark.timeout(90)

STEPS = 10
GLOBAL_BATCH = 8
SEQ = 16
MAX_NORM = 0.5  # below the early grad norms: clipping is exercised
TOL = 1e-4
CPU = torch.device("cpu")
LAYOUTS = {  # name -> (degrees, model.moe_balance)
    "fsdp2_bias": (dict(dp_shard=2), "bias"),
    "ddp2_bias": (dict(dp_replicate=2), "bias"),
    "fsdp2_aux_loss": (dict(dp_shard=2), "aux_loss"),
}


def _args(balance: str) -> ModelArgs:
    return ModelArgs(**{**size_spec("tiny-moe"), "vocab_size": 64, "max_seq_len": SEQ, "moe_balance": balance,
                        "moe_bias_rate": 0.01, "moe_aux_coef": 0.01})


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed global batch, seen every step: the loss must fall (memorisation)."""
    tokens = torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000))
    return tokens[:, :-1], tokens[:, 1:]


def _train(balance: str, degrees: dict | None = None) -> dict:
    """Losses, grad norms and MoE figures per step, and the final biases (rank-local values)."""
    args = _args(balance)
    model = Transformer(args, seed=7)
    dp_rank, dp_size, world = 0, 1, 1
    if degrees is not None:
        world = dist.get_world_size()
        dims = ParallelDims(**{"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **degrees}, world_size=world)
        mesh = dims.build_mesh("cpu")
        model = parallelize_nd(model, dims, mesh, device=CPU)
        dp_rank, dp_size = dims.dp_rank(mesh), dims.dp_size
    stats = MoEStats.of([model], args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    per_rank = GLOBAL_BATCH // dp_size
    out = {"losses": [], "norms": [], "figures": []}
    for _ in range(STEPS):
        inputs, targets = _batch()
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        loss, norm, _ = train_step(model, optimizer, iter([(inputs[rows], targets[rows])]), grad_accum=1,
                                   device=CPU, dtype="fp32", grad_clip=MAX_NORM)
        out["figures"].append(stats.after_step(True, CPU))
        out["losses"].append(mean_loss_across_ranks(loss, world))
        out["norms"].append(float(norm))
    out["bias"] = [m.expert_bias.tolist() for m in model.modules() if isinstance(m, MoE)] \
        if balance == "bias" else None
    return out


def _rank_layouts() -> dict[str, dict]:
    return {name: _train(balance, degrees) for name, (degrees, balance) in LAYOUTS.items()}


def test_tiny_moe_fsdp_and_ddp_match_one_process():
    ranks = run_distributed(_rank_layouts, world_size=2, timeout=60)
    for name, (_, balance) in LAYOUTS.items():
        ref = _train(balance)
        if balance == "bias":  # the bias moved the routing: the all-reduced load is exercised
            assert any(b != 0 for layer in ref["bias"] for b in layer)
        for rank, got in enumerate(ranks):
            run = got[name]
            where = f"{name} rank {rank}"
            assert run["losses"] == pytest.approx(ref["losses"], abs=TOL), where
            assert run["norms"] == pytest.approx(ref["norms"], abs=TOL), where
            assert run["bias"] == ref["bias"], where
            for step, (figures, expected) in enumerate(zip(run["figures"], ref["figures"], strict=True)):
                assert figures == pytest.approx(expected, abs=TOL), f"{where} step {step + 1}"
        assert ranks[0][name]["figures"] == ranks[1][name]["figures"], f"{name}: the ranks log different figures"
        assert ref["losses"][-1] < ref["losses"][0] - 0.3, f"{name}: the reference did not learn"
