"""train.compile x {DDP + activation checkpointing, FSDP, TP 2}: compiled training matches eager training.

One 2-rank launch trains each layout twice through meshrun's own path (parallelize_nd, then
apply_compile as build_layout does it, train_step): eagerly, then compiled by inductor: DDP's
model whole, in one graph (with its checkpointed blocks inside), FSDP's and TP's block by block.
A tiny Transformer (dim 32, 2 blocks: the whole-model graph is DDP's compile cost; seq 16), fp32, AdamW, clipping, STEPS
steps on one fixed global batch. The loss every rank logs must match eager within TOL at every
step. The blocks share one graph per layout, so this costs three inductor compiles.

The cache survives a restart: the launch compiles into a fresh cache directory (what
`use_run_cache` points a run at, <run dir>/compile-cache), then a second launch of new processes,
as a restarted run, compiles DDP again from it: inductor's FX graph cache and AOTAutograd's cache
count only hits (their own counters, not a timing).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.compile import apply_compile
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.parallelize import parallelize_nd
from meshrun.testing import RankExitedError, run_distributed
from meshrun.train.step import mean_loss_across_ranks, train_step

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # room for one rerun (_launch)

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 16
TOL = 1e-4  # measured: at most 1.2e-7 (inductor reorders fp32 sums, nothing more)
ARGS = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=SEQ)
# TP with sequence parallel, as torchtitan runs it: TP alone is refused (rules.check_compile).
LAYOUTS = {"ddp2": dict(dp_replicate=2, activation_checkpointing=True), "fsdp2": dict(dp_shard=2),
           "tp2_sp": dict(tp=2, sequence_parallel=True)}
BLOCKS = [f"layers.{i}" for i in range(ARGS["n_layers"])]
COMPILED = {"ddp2": ["Transformer"], "fsdp2": BLOCKS, "tp2_sp": BLOCKS}  # whole where the tensors are plain
CPU = torch.device("cpu")


def _train(layout: dict, compiled: bool) -> tuple[list[float], list[str], int]:
    dims = ParallelDims(dp_replicate=layout.get("dp_replicate", 1), dp_shard=layout.get("dp_shard", 1),
                        tp=layout.get("tp", 1), pp=1, world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    names: list[str] = []

    def materialize(module):  # build_layout's hook: compile once tp/AC/fsdp are applied, before ddp
        names.extend(apply_compile(module, True if compiled else False))

    model = parallelize_nd(Transformer(ModelArgs(**ARGS), seed=7), dims, mesh, device=CPU, materialize=materialize,
                           sequence_parallel=layout.get("sequence_parallel", False),
                           activation_checkpointing=layout.get("activation_checkpointing", False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1000)
    tokens = torch.randint(0, ARGS["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=gen)
    dp_rank, per = dims.dp_rank(mesh), GLOBAL_BATCH // dims.dp_size
    rows = tokens[dp_rank * per:(dp_rank + 1) * per]
    batches = iter(lambda: (rows[:, :-1], rows[:, 1:]), None)
    losses = []
    for _ in range(STEPS):
        loss, _, _ = train_step(model, optimizer, batches, grad_accum=1, device=CPU, dtype="fp32", grad_clip=0.5)
        losses.append(mean_loss_across_ranks(loss, dist.get_world_size()))
    from torch._dynamo.utils import counters

    return losses, names, counters["stats"]["unique_graphs"]  # graphs dynamo compiled so far


def _rank_all() -> dict:
    return {f"{name}/{'compiled' if on else 'eager'}": _train(layout, on)
            for name, layout in LAYOUTS.items() for on in (False, True)}


def _rank_restarted() -> dict:
    """A restarted run's processes: DDP compiled again, from the cache the first launch filled."""
    from torch._dynamo.utils import counters

    losses, _, _ = _train(LAYOUTS["ddp2"], True)
    return {"losses": losses, "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"]}


def _launch(fn, timeout: float, env: dict) -> list:
    """run_distributed, run once more when a rank died of a native crash (SIGSEGV or SIGABRT).

    CI once saw rank 0 segfault here: a gloo worker thread crashed while the main thread was in
    DTensor's reduce-scatter under eager TP + SP. That is torch 2.13's gloo, not this code: plain
    torch TP + SP steps in a loop crashed the same way here, once in about 50,000 reduce-scatters
    (docs/diagnose.md), and 12 runs of this file did not. The rerun is a new launch that must
    pass whole. The crash is not hidden: it is a warning in the summary, and the rank's stderr
    holds each thread's C++ stack (the harness turns torch's handler on).
    A rank that raised, or a second crash, fails as before."""
    try:
        return run_distributed(fn, world_size=2, timeout=timeout, env=env)
    except RankExitedError as err:
        if err.signal_name not in ("SIGSEGV", "SIGABRT"):
            raise
        warnings.warn(f"compile parity: rerun after a native crash: {str(err).splitlines()[0]}", stacklevel=2)
    return run_distributed(fn, world_size=2, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory) -> dict:
    from meshrun.parallel.compile import use_run_cache

    env = {"OMP_NUM_THREADS": "1"}
    use_run_cache(tmp_path_factory.mktemp("run"), env)  # what the worker does for a run directory
    return env


@pytest.fixture(scope="module")
def runs(cache_env) -> list[dict]:
    return _launch(_rank_all, 280, cache_env)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_eager(runs, name):
    for rank, result in enumerate(runs):
        eager, _, _ = result[f"{name}/eager"]
        compiled, blocks, graphs = result[f"{name}/compiled"]
        assert blocks == COMPILED[name], blocks
        assert graphs >= 1, "dynamo compiled nothing"
        diff = max(abs(a - b) for a, b in zip(eager, compiled, strict=True))
        if rank == 0:
            print(f"{name}: compiled vs eager max loss difference {diff:.1e}")
        assert diff < TOL, f"{name} rank {rank}: {compiled} vs eager {eager}"
        assert eager[-1] < eager[0], f"{name}: the run should learn"


def test_a_restarted_run_compiles_from_the_cache(runs, cache_env):
    first = [result["ddp2/compiled"][0] for result in runs]
    again = _launch(_rank_restarted, 200, cache_env)
    for rank, result in enumerate(again):
        assert result["fx_hit"] > 0 and result["fx_miss"] == 0, result
        assert result["aot_hit"] > 0, result
        assert result["losses"] == first[rank], (result["losses"], first[rank])  # the same kernels
