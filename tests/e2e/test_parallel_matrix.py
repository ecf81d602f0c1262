"""The N-D parity matrix: every layout trains like one process, and memory is what the plan says.

One 4-rank launch (process starts are the cost here) trains each layout in turn on a fresh mesh
through meshrun's own code path (parallelize_nd / parallelize_pipeline, train_step /
train_step_pp, the trainer's loss averaging, evaluate / evaluate_pp): a tiny Transformer (dim 32,
4 blocks, 4 heads, vocab 64, seq 16), fp32, AdamW, 6 steps on one fixed global batch of 8
sequences, gradient clipping that really clips. Against a single-process run of the same code,
the loss every rank logs must match at every step within 1e-4 (measured: at most 7.2e-7), and the
clipped grad norm and the eval loss too; the context-parallel layouts (the sequence split over
cp ranks, attention as torch's ring) train CP_STEPS steps against a reference as long. Per layout each rank also reports the local bytes of
its parameters, gradients and AdamW state (DTensor shards counted by `to_local()`) and the peak
bytes autograd held saved for backward in the last step (`SavedActivations`), which the memory and
planner checks use, and, for the context-parallel layouts, the bytes the ring received in that step
(`Collectives.received`), which must be within 10% of `meshrun plan`'s count. Then `meshrun train` runs
pp=2 end to end through the CLI.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os

import pytest
import torch
import torch.distributed as dist
from conftest import EXAMPLES, meshrun
from torch.distributed.tensor.parallel import loss_parallel

from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.context import ContextParallel
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.parallelize import parallelize_nd, parallelize_pipeline
from meshrun.parallel.pipeline import resolve_pipeline
from meshrun.plan import estimate
from meshrun.plan.measure import Collectives, SavedActivations, local_bytes
from meshrun.testing import run_distributed
from meshrun.train.step import (
    evaluate,
    evaluate_pp,
    lm_loss,
    mean_loss_across_ranks,
    sequence_context,
    train_step,
    train_step_pp,
)

pytestmark = pytest.mark.timeout(400)

STEPS = 6  # every layout's parity shows from step 1 on; 6 are enough to see the run learn (> 0.5)
STEPS_3D = 4  # the 8-rank case: see its test
CP_STEPS = 10  # context parallel: its losses must stay with one process's over 10 steps
GLOBAL_BATCH = 8
SEQ = 16
MAX_NORM = 0.5
TOL = 1e-4
ARGS = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=4, max_seq_len=SEQ)
CPU = torch.device("cpu")

# name -> degrees (+ pp schedule / stages per rank, + parallelize options)
LAYOUTS = {
    "ddp4": dict(dp_replicate=4),
    "fsdp4": dict(dp_shard=4),
    "hsdp2x2": dict(dp_replicate=2, dp_shard=2),
    "tp2_dp2": dict(dp_replicate=2, tp=2),
    "tp4": dict(tp=4),
    "tp2_dp2_sp_loss_parallel": dict(dp_replicate=2, tp=2, sequence_parallel=True, loss_parallel=True),
    "fsdp2_tp2": dict(dp_shard=2, tp=2),
    "pp2_gpipe_dp2": dict(pp=2, dp_replicate=2, schedule="gpipe"),
    "pp2_1f1b_dp2": dict(pp=2, dp_replicate=2, schedule="1f1b"),
    "pp2_interleaved_1f1b_dp2": dict(pp=2, dp_replicate=2, schedule="interleaved_1f1b", stages_per_rank=2),
    "pp2_fsdp2": dict(pp=2, dp_shard=2, schedule="1f1b"),
    "pp2_tp2": dict(pp=2, tp=2, schedule="gpipe"),
    "pp2_looped_bfs_fsdp2": dict(pp=2, dp_shard=2, schedule="looped_bfs"),
    "pp2_zero_bubble_tp2": dict(pp=2, tp=2, schedule="interleaved_zero_bubble"),
    "pp4_1f1b": dict(pp=4, schedule="1f1b"),
    # Context parallel (seq 16 in 2 x cp chunks, head-tail), sharded with FSDP over dp_shard x cp.
    "cp2_fsdp2": dict(cp=2, dp_shard=2, steps=CP_STEPS),
    "cp2_hsdp2": dict(cp=2, dp_replicate=2, steps=CP_STEPS),  # HSDP over (dp_replicate, dp_shard_cp)
    "cp4": dict(cp=4, steps=CP_STEPS),
    "cp2_tp2": dict(cp=2, tp=2, steps=CP_STEPS),
    "cp2_pp2": dict(cp=2, pp=2, schedule="1f1b", steps=CP_STEPS),  # every stage gets its share's positions
    # Mixed precision: bf16 compute, fp32 gradient reduction; tracks fp32 within BF16_TOL.
    "fsdp4_bf16": dict(dp_shard=4, param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}
EXACT = [name for name in LAYOUTS if "bf16" not in name]
BF16_TOL = 5e-2  # measured below 1e-2 over 10 steps here (6 now) (bf16 keeps 8 mantissa bits)


def _batches(dp_rank: int, dp_size: int, seed: int = 1000):
    """The same fixed global batch every step; this dp rank's rows of it."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ARGS["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=gen)
    per = GLOBAL_BATCH // dp_size
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    while True:
        yield tokens[rows, :-1], tokens[rows, 1:]


def _memory(parts, optimizers) -> dict[str, int]:
    params = [p for part in parts for p in part.parameters()]
    states = [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params if p.grad is not None),
            "optim": local_bytes(states)}


def _train_layout(layout: dict, world_size: int, steps: int = STEPS) -> dict:
    """Train one layout with meshrun's functions for `steps` steps; on one process when world_size is 1."""
    opts = dict(layout)
    schedule, per_rank = opts.pop("schedule", None), opts.pop("stages_per_rank", 0)
    steps = opts.pop("steps", steps)
    dims = ParallelDims(dp_replicate=opts.pop("dp_replicate", 1), dp_shard=opts.pop("dp_shard", 1),
                        tp=opts.pop("tp", 1), pp=opts.pop("pp", 1), world_size=world_size, cp=opts.pop("cp", 1))
    cp = None
    model = Transformer(ModelArgs(**ARGS), seed=7)
    lp = opts.get("loss_parallel", False)
    if world_size == 1:
        parts, pipeline, dp_rank, pp_group = [model], None, 0, None
    else:
        mesh = dims.build_mesh("cpu")
        dp_rank = dims.dp_rank(mesh)
        cp = ContextParallel(mesh["cp"]) if dims.cp_enabled else None
        if dims.pp_enabled:
            plan = resolve_pipeline(pp=dims.pp, schedule=schedule, stages_per_rank=per_rank, split_points="",
                                 n_layers=ARGS["n_layers"], batch_size=GLOBAL_BATCH // dims.dp_size,
                                 microbatches=0, dp_size=dims.dp_size)
            pipeline = parallelize_pipeline(model, dims, mesh, plan, device=CPU, **opts)
            parts, pp_group = pipeline.parts, mesh["pp"].get_group()
        else:
            parts, pipeline, pp_group = [parallelize_nd(model, dims, mesh, device=CPU, **opts)], None, None
    optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-2, weight_decay=0.1) for part in parts]
    batches = _batches(dp_rank, dims.dp_size)
    step_args = dict(grad_accum=1, device=CPU, dtype="fp32", grad_clip=MAX_NORM)
    losses, norms = [], []

    def state():
        return itertools.chain(*(part.parameters() for part in parts), *(part.buffers() for part in parts))

    for step in range(steps):
        # The last step's peak saved-for-backward bytes are the activations: a steady-state step
        # (torch's pipeline re-runs a metadata forward on the first step and after each eval).
        last = step == steps - 1
        with SavedActivations(state) if last else contextlib.nullcontext() as acts, \
                Collectives() if last else contextlib.nullcontext() as received:
            if pipeline is not None:
                loss, norm, _ = train_step_pp(pipeline, optimizers, batches, pp_group=pp_group,
                                              context_parallel=cp, **step_args)
            else:
                loss, norm, _ = train_step(parts[0], optimizers[0], batches, loss_parallel=lp,
                                           context_parallel=cp, **step_args)
        losses.append(mean_loss_across_ranks(loss, world_size, dims.pp))
        norms.append(float(norm))
    val = _batches(dp_rank, dims.dp_size, seed=2000)
    if pipeline is not None:
        local = evaluate_pp(pipeline, val, steps=1, device=CPU, dtype="fp32", context_parallel=cp)
    else:
        local = evaluate(parts[0], val, steps=1, device=CPU, dtype="fp32", loss_parallel=lp, context_parallel=cp)
    eval_loss = mean_loss_across_ranks(local, world_size, dims.pp)
    # One more backward (no step) so that gradients exist while the bytes are counted.
    inputs, targets = next(batches)
    if pipeline is not None:
        with sequence_context(cp, inputs, targets) as (inputs, targets, positions):
            pipeline.step(inputs, targets, positions=positions)
    else:
        with loss_parallel() if lp else contextlib.nullcontext(), \
                sequence_context(cp, inputs, targets) as (inputs, targets, positions):
            lm_loss(parts[0], inputs, targets, positions).backward()
    memory = {**_memory(parts, optimizers), "activations": acts.peak, "ring": received.received}
    names = sorted(n.removeprefix("module.") for part in parts for n, _ in part.named_parameters())
    return {"losses": losses, "norms": norms, "eval": eval_loss, "memory": memory, "names": names}


def _rank_train_all(layouts: dict[str, dict], steps: int = STEPS) -> dict[str, dict]:
    return {name: _train_layout(layout, dist.get_world_size(), steps) for name, layout in layouts.items()}


@pytest.fixture(scope="module")
def reference() -> dict:
    return _train_layout({}, 1)


@pytest.fixture(scope="module")
def reference_cp() -> dict:
    """The single-process run as long as the context-parallel layouts' (CP_STEPS)."""
    return _train_layout({}, 1, CP_STEPS)


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_rank_train_all, world_size=4, args=(LAYOUTS,), timeout=360,
                           env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("name", EXACT)
def test_layout_matches_one_process(runs, reference, reference_cp, name):
    if "steps" in LAYOUTS[name]:
        reference = reference_cp
        assert len(reference["losses"]) == LAYOUTS[name]["steps"]
    ref_losses = torch.tensor(reference["losses"])
    assert ref_losses[-1] < ref_losses[0] - 0.5, "the reference run should learn"
    assert reference["norms"][0] > MAX_NORM, "clipping should be active"
    for rank, result in enumerate(runs):
        got = result[name]
        diff = (torch.tensor(got["losses"]) - ref_losses).abs().max().item()
        if rank == 0:
            print(f"{name}: max loss difference {diff:.1e}")
        assert diff < TOL, f"{name} rank {rank}: loss differs by {diff:.2e}: {got['losses']}"
        norm_diff = (torch.tensor(got["norms"]) - torch.tensor(reference["norms"])).abs().max().item()
        assert norm_diff < TOL, f"{name} rank {rank}: grad norm differs by {norm_diff:.2e}"
        assert abs(got["eval"] - reference["eval"]) < TOL, f"{name} rank {rank}: eval {got['eval']}"


def test_pipeline_stages_keep_the_original_parameter_names(runs, reference):
    for name, layout in LAYOUTS.items():
        if layout.get("pp", 1) > 1:
            held = [set(r[name]["names"]) for r in runs]
            assert set().union(*held) == set(reference["names"]), name
            assert all(len(h) < len(reference["names"]) for h in held), f"{name}: a stage holds everything"


def test_bf16_params_with_fp32_reduce_track_fp32(runs, reference):
    losses = torch.tensor(runs[0]["fsdp4_bf16"]["losses"])
    diff = (losses - torch.tensor(reference["losses"])).abs().max().item()
    print(f"bf16 vs fp32 max loss difference over {STEPS} steps: {diff:.2e}")
    assert diff < BF16_TOL, losses.tolist()
    assert losses[-1] < losses[0] - 0.5, "the bf16 run should learn too"


def _state(memory: dict[str, int]) -> int:
    return memory["params"] + memory["grads"] + memory["optim"]


def test_fsdp_shards_params_grads_and_optimizer_state(runs):
    ddp = max(_state(r["ddp4"]["memory"]) for r in runs)
    fsdp = max(_state(r["fsdp4"]["memory"]) for r in runs)
    print(f"per-rank params+grads+AdamW bytes: ddp4 {ddp}, fsdp4 {fsdp} ({fsdp / ddp:.3f} of DDP)")
    assert fsdp <= ddp / 4 * 1.05, (fsdp, ddp)


@pytest.mark.parametrize("name", EXACT)
def test_plan_estimate_is_within_20_percent_of_measured(runs, name):
    """State (params + grads + AdamW) and activations (peak saved for backward), per rank."""
    layout = LAYOUTS[name]
    dims = ParallelDims(dp_replicate=layout.get("dp_replicate", 1), dp_shard=layout.get("dp_shard", 1),
                        tp=layout.get("tp", 1), pp=layout.get("pp", 1), world_size=4, cp=layout.get("cp", 1))
    est = estimate(ModelArgs(**ARGS), dims, batch_size=GLOBAL_BATCH // dims.dp_size, seq_len=SEQ,
                   sequence_parallel=layout.get("sequence_parallel", False),
                   loss_parallel=layout.get("loss_parallel", False),
                   pp_schedule=layout.get("schedule", "gpipe"), pp_stages_per_rank=layout.get("stages_per_rank", 0))
    # the most-loaded rank, as the plan counts
    state = max(_state(r[name]["memory"]) for r in runs)
    acts = max(r[name]["memory"]["activations"] for r in runs)
    total = max(_state(r[name]["memory"]) + r[name]["memory"]["activations"] for r in runs)
    planned = est.state + est.activations
    print(f"{name}: state plan {est.state} measured {state} ({est.state / state - 1:+.1%}); "
          f"activations plan {est.activations} measured {acts} ({est.activations / acts - 1:+.1%}); "
          f"total plan {planned} measured {total} ({planned / total - 1:+.1%})")
    assert acts > 0, name
    assert abs(est.state - state) <= 0.2 * state, (name, est.state, state)
    assert abs(est.activations - acts) <= 0.2 * acts, (name, est.activations, acts)
    assert abs(planned - total) <= 0.2 * total, (name, planned, total)
    if dims.cp > 1:  # what the ring moved in that step, against the plan's count (meshrun.plan.ring)
        ring = max(r[name]["memory"]["ring"] for r in runs)
        print(f"{name}: ring bytes per step plan {est.ring} measured {ring}")
        assert ring > 0 and abs(est.ring - ring) <= 0.1 * ring, (name, est.ring, ring)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MESHRUN_TEST_8_RANKS") == "0",
                    reason="MESHRUN_TEST_8_RANKS=0: the 8-process 3-D case (45-90 s on 2 cores) is off")
def test_3d_pp2_fsdp2_tp2_matches_one_process():
    """pp 2 x fsdp 2 x tp 2 on 8 ranks (measured here: loss 4.8e-7, grad norm 2.4e-6 from one process).

    STEPS_3D steps, not STEPS: 8 ranks on 2 cores cost seconds a step, and the 4-rank layouts
    above already cover training STEPS steps; here 4 steps, clipped (a first norm above MAX_NORM),
    with AdamW's state carried from step to step, show the 3-D composition trains like one process."""
    reference = _train_layout({}, 1, STEPS_3D)
    assert reference["norms"][0] > MAX_NORM, "clipping should be active"
    layout = {"pp2_fsdp2_tp2": dict(pp=2, dp_shard=2, tp=2, schedule="1f1b")}
    results = run_distributed(_rank_train_all, world_size=8, args=(layout, STEPS_3D), timeout=300,
                              env={"OMP_NUM_THREADS": "1"})
    for rank, result in enumerate(results):
        got = result["pp2_fsdp2_tp2"]
        diff = max(abs(a - b) for a, b in zip(got["losses"], reference["losses"], strict=True))
        norm_diff = max(abs(a - b) for a, b in zip(got["norms"], reference["norms"], strict=True))
        assert diff < TOL and norm_diff < TOL and abs(got["eval"] - reference["eval"]) < TOL, (rank, got)


def test_meshrun_train_pp2_through_the_cli_matches_one_process(tmp_path):
    """pp 2 x fsdp 2 (4 processes) with gradient accumulation vs one process on the same global
    batch (8 = 2 per micro-batch x 2 accumulated x 2 dp ranks), and the saved weights."""
    common = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "train.steps=6",
              "--set", "metrics.interval=1", "--set", "train.eval_interval=0", "--set", "train.eval_steps=1",
              "--set", f"train.run_dir={tmp_path}"]
    runs = {
        "single": ["--nproc-per-node", "1", "--set", "train.batch_size=8"],
        # eval_steps 2: two batches of 2 on each of 2 dp ranks are the single run's one batch of 8
        "pp2": ["--nproc-per-node", "4", "--set", "train.batch_size=2", "--set", "train.grad_accum=2",
                "--set", "train.eval_steps=2",
                "--set", "parallel.strategy=fsdp",
                "--set", "parallel.pp=2", "--set", "parallel.pp_schedule=1f1b"],
    }
    rows = {}
    for name, args in runs.items():
        result = meshrun("train", str(EXAMPLES / "configs" / "tiny.toml"), "--set", f"train.name={name}",
                         *common, *args, timeout=180, cwd=tmp_path)
        assert result.returncode == 0, result.output
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        rows[name] = {kind: [r for r in records if r.get("kind") == kind] for kind in ("train", "eval")}
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "eval_loss")):
        single = [r[key] for r in rows["single"][kind]]
        pp = [r[key] for r in rows["pp2"][kind]]
        assert len(pp) == len(single) > 0 and max(abs(a - b) for a, b in zip(pp, single, strict=True)) < TOL, (key, pp, single)
    from meshrun.config import load_config
    from meshrun.models.factory import build_model

    model = build_model(load_config(tmp_path / "pp2" / "config.toml").model, 259)
    model.load_state_dict(torch.load(tmp_path / "pp2" / "model.pt", weights_only=True))  # both stages, original names


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--nproc-per-node", "4", "--set", "parallel.dp_replicate=1", "--set", "parallel.pp=2"],
         "does not equal the world size 4"),
        (["--nproc-per-node", "4", "--set", "parallel.strategy=fsdp", "--set", "parallel.dp_shard=1",
          "--set", "parallel.tp=4", "--set", "model.n_heads=2"], "parallel.tp=4 does not divide"),
        (["--nproc-per-node", "4", "--set", "parallel.pp=4"], "exceeds model.n_layers=2"),
        (["--nproc-per-node", "2", "--set", "parallel.pp=2", "--set", "parallel.pp_microbatches=3"],
         "parallel.pp_microbatches=3 does not divide train.batch_size=8"),
        (["--nproc-per-node", "2", "--set", "parallel.pp=2", "--set", "parallel.pp_schedule=interleaved_1f1b",
          "--set", "parallel.pp_stages_per_rank=1"], "interleaves several stages per rank"),
    ],
)
def test_bad_layouts_fail_in_one_line_before_any_process_starts(tmp_path, args, expected):
    result = meshrun("train", str(EXAMPLES / "configs" / "tiny.toml"), "--set", f"train.run_dir={tmp_path}",
                     *args, timeout=60, cwd=tmp_path)
    assert result.returncode == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.output and not list(tmp_path.iterdir())  # no run directory
