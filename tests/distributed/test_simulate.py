"""`meshrun plan --simulate` is exact at small sizes: a simulated rank equals the real one.

A gloo launch of 2, 4 or 8 ranks per layout builds it through the trainer's path
(`resolve_layout`, `build_layout`, meshrun's optimizer, one `layout_step`) and records, on every
rank, the bytes of its local parameters, gradients and optimizer state, every collective of the
step (kind, mesh dimension, count, bytes; `meshrun.plan.measure.Collectives`) and the step's peak
memory with the optimizer state there (torch's MemTracker). Then this process simulates the
layout's representative ranks, as `meshrun plan --simulate` does
(`meshrun.train.simulate.simulate_rank_isolated`: a fake process group and fake tensors, nothing
computed, each rank in a child of the harness's forkserver, so a clean torch), and must find the
same bytes and collectives exactly and the same peak (within 10%, the bar; where it is measured
equal, within 3% and with the same state held at it). With 4 and 5 micro-batches the simulation runs 3 and counts the middle one's
collectives again for the rest. Pipelines (1F1B, interleaved 1F1B, zero bubble, GPipe over tp x cp)
are measured in their second step, in the real launch as in the simulation: the schedule's first
infers the stages' shapes; their sends and receives are in the inventory. tiny-moe's experts over
ep (within fsdp, beside tp, inside pp stages): the simulation routes evenly, and so does the real
launch's router here (_balanced_routes); a model.hf Qwen2-MoE the same way. LoRA, a tied head, CPU
offload, loss parallel, cp 4 and cp x tp too. Every other real rank
must hold and send what one of the representatives does: the report covers every rank. Through
the CLI: `meshrun plan --simulate` of tiny (an uneven 259-token vocabulary) under FSDP 4 x TP 2 on
8 ranks, its --json, and a pipeline layout with its projected bubble.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from meshrun.models.llama import ModelArgs, Transformer
from meshrun.models.sizes import size_spec
from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
from meshrun.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

WORLD = 4
SEQ = 16
ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
OPTIM = SimpleNamespace(name="adamw", lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                        implementation="auto")
LAYOUTS = {  # name -> (world, ParallelOptions keywords); batch_size: per data-parallel rank
    "fsdp2": (2, dict(strategy="fsdp", dp_shard=2)),
    "tp2_sp_loss_parallel": (2, dict(strategy="fsdp", dp_shard=1, tp=2, sequence_parallel=True, loss_parallel=True)),
    "tp2_tied": (2, dict(strategy="fsdp", dp_shard=1, tp=2)),  # TIED_ARGS: the shared matrix stays replicated
    "fsdp2_ac_no_reshard_offload": (2, dict(strategy="fsdp", dp_shard=2, activation_checkpointing=True,
                                            fsdp_reshard_after_forward=False, fsdp_cpu_offload=True)),
    "ddp4": (4, dict(strategy="ddp")),
    "fsdp4": (4, dict(strategy="fsdp", dp_shard=4)),
    "hsdp2x2_grad_accum4": (4, dict(strategy="fsdp", dp_replicate=2, dp_shard=2, grad_accum=4)),
    "fsdp2_tp2": (4, dict(strategy="fsdp", dp_shard=2, tp=2)),
    "fsdp2_tp2_bf16": (4, dict(strategy="fsdp", dp_shard=2, tp=2, dtype="bf16")),
    "tp2_dp2_sp": (4, dict(strategy="fsdp", dp_replicate=2, dp_shard=1, tp=2, sequence_parallel=True)),
    "cp2_fsdp2": (4, dict(strategy="fsdp", dp_shard=2, cp=2)),
    "cp4": (4, dict(strategy="fsdp", dp_shard=1, cp=4)),
    "cp2_tp2": (4, dict(strategy="fsdp", dp_shard=1, cp=2, tp=2)),
    "fsdp4_ac_grad_accum5": (4, dict(strategy="fsdp", dp_shard=4, activation_checkpointing=True, grad_accum=5)),
    "hsdp2x2_tp2_sp": (8, dict(strategy="fsdp", dp_replicate=2, dp_shard=2, tp=2, sequence_parallel=True)),
    # pipelines: the stages' sends and receives counted too (measured in the second step: the first infers shapes)
    "pp2_1f1b_fsdp2": (4, dict(strategy="fsdp", dp_shard=2, pp=2, pp_schedule="1f1b", batch_size=4)),
    "pp2_interleaved_1f1b_dp2_bf16": (4, dict(strategy="ddp", dp_replicate=2, pp=2, pp_schedule="interleaved_1f1b",
                                              pp_stages_per_rank=2, batch_size=4, dtype="bf16")),
    "pp2_gpipe_tp2_cp2": (8, dict(strategy="fsdp", dp_shard=1, pp=2, tp=2, cp=2, batch_size=4)),
    "pp2_looped_bfs_fsdp2": (4, dict(strategy="fsdp", dp_shard=2, pp=2, pp_schedule="looped_bfs",
                                     pp_stages_per_rank=2, batch_size=4)),
    "pp2_zero_bubble_tp2_grad_accum3": (4, dict(strategy="fsdp", dp_shard=1, pp=2, tp=2,
                                                pp_schedule="interleaved_zero_bubble", batch_size=4, grad_accum=3)),
    # tiny-moe (MOE_ARGS): the experts over ep 2, FSDP-sharded over the 2 ranks holding the same ones
    # (efsdp); tokens travel by all-to-all. The simulation routes evenly (no values to route by), so
    # the real launch's router is made to as well (_balanced_routes)
    # LoRA (rank 4 on the attention and MLP projections, the base frozen): a checkpoint holds the adapters
    "lora_fsdp2_bf16": (2, dict(strategy="fsdp", dp_shard=2, dtype="bf16")),
    "moe_ep2_fsdp4": (4, dict(strategy="fsdp", dp_shard=4, ep=2)),
    # a model.hf mixture of experts (tests/hf_zoo.py's Qwen2-MoE: 4 experts, top 2, a gated shared
    # expert), transformers' experts computing through meshrun's ep routing; bf16: torch's fake
    # grouped GEMM, what transformers' experts run on CPU, takes bf16 only
    "hf_qwen2_moe_ep2_fsdp4_bf16": (4, dict(strategy="fsdp", dp_shard=4, ep=2, dtype="bf16")),
    "moe_ep2_tp2_sp": (4, dict(strategy="fsdp", dp_shard=2, ep=2, tp=2, sequence_parallel=True)),
    "moe_ep2_pp2": (4, dict(strategy="fsdp", dp_shard=2, ep=2, pp=2, batch_size=4)),
}
TIED_ARGS = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": True})
MOE_ARGS = ModelArgs(**{**size_spec("tiny-moe"), "vocab_size": 64, "max_seq_len": SEQ, "n_layers": 2})


PEAK_TOL = 0.10  # the bar: the simulated peak within 10% of the real one
# Measured equal for all but these: DDP's (the simulation's all-reduce hook stands in for DDP's own:
# -2.1%) and bf16's (FSDP's casts: -1.7%). Where they are, the state held at the peak (weights,
# buffers, optimizer state: PEAK_STATE) is asserted equal and the total within PEAK_TIGHT, so a
# change that moves the simulation away from the real step shows at once. Not the total exactly:
# a real rank's gradients and activations at its peak depend on when gloo completes a reduce-scatter
# (fsdp4's rank 3 once peaked 1.5% higher, 16 KiB counted as activation instead of gradient, plus
# 12 KiB of temporaries; the simulation is the same every time).
# Pipelines: a sent activation is held until its send completes, which in a real run depends on
# when the peer receives (two real ranks of one stage differed by 1.0%; the simulation: 16 bytes).
# Context parallel: its ring exchanges key/value blocks point to point as well, and a real rank's
# peak moved by up to 0.5% between two launches of cp 4 (the simulation's: the same every time).
# transformers' experts (Qwen2-MoE, bf16): +1.2%, in activations (the bytes and collectives equal).
PEAK_TIGHT = 0.03
PEAK_STATE = ("param", "buffer", "optim")
PEAK_INEXACT = {"ddp4", "fsdp2_tp2_bf16", "hf_qwen2_moe_ep2_fsdp4_bf16",
                *(name for name in LAYOUTS if {"pp2", "cp2", "cp4"} & set(name.split("_")))}


def _args(name: str) -> ModelArgs:
    return MOE_ARGS if name.startswith("moe") else TIED_ARGS if "tied" in name else ARGS


def _model(name: str, hf_dir: str = "") -> torch.nn.Module:
    from meshrun.config.lora_section import LoraSection
    from meshrun.models.hf import build_hf_model
    from meshrun.models.lora import apply_run_lora
    from meshrun.models.meta import on_meta

    if name.startswith("hf_"):
        with on_meta():
            return build_hf_model(hf_dir, seed=0)
    with torch.device("meta"):
        model = Transformer(_args(name))
    lora = LoraSection(rank=4 if name.startswith("lora") else 0)
    return apply_run_lora(model, lora, LAYOUTS[name][1].get("dtype", "fp32"))


def _layout(name: str, hf_dir: str = ""):
    world, options = LAYOUTS[name]
    shape = ModelShape.from_model(_model(name, hf_dir)) if hf_dir else ModelShape.from_args(_args(name))
    return resolve_layout(ParallelOptions(**{"batch_size": 2, **options}, seq_len=SEQ), world, shape)


def _hf_dir(name: str, tmp_path) -> str:  # noqa: ANN001 - a Path
    """The model.hf directory of an hf_ layout, saved into `tmp_path`; '' for the others."""
    if not name.startswith("hf_"):
        return ""
    import hf_zoo

    return str(hf_zoo.save_tiny(tmp_path / "hf", "qwen2_moe" if "qwen2_moe" in name else name.split("_")[1]))


def _balanced_routes(model: torch.nn.Module) -> None:
    """Every MoE router of `model` sends token t's j-th choice to expert (t k + j) mod experts: each
    expert gets the same number of tokens, the route the simulation assumes (it has no values)."""
    from meshrun.models.moe import MoE
    from meshrun.parallel.expert_parallel import hf_routed

    def even(module, inputs, output):  # noqa: ANN001, ANN202 - a forward hook
        weights, indices, scores = output
        slots = torch.arange(indices.numel(), device=indices.device).view_as(indices)
        return weights, slots % scores.shape[-1], scores

    def even_hf(module, inputs):  # noqa: ANN001, ANN202 - transformers' experts: (hidden, top-k ids, weights)
        hidden, indices, weights = inputs
        slots = torch.arange(indices.numel(), device=indices.device).view_as(indices)
        return hidden, slots % module.num_experts, weights

    for module in model.modules():
        if isinstance(module, MoE):
            module.router.register_forward_hook(even)
        elif hf_routed(module):
            module.register_forward_pre_hook(even_hf)


def _optimizer(part):
    from meshrun.train.optimizers import build_optimizer

    return build_optimizer(part, OPTIM)


def _real_rank(name: str, ckpt_dir: str, hf_dir: str = ""):
    """One layout's step on this rank of a real gloo launch: what `simulate_rank` must find; then
    a real checkpoint save of it into `ckpt_dir` (DCP: one file per rank, `__<rank>_0.distcp`)."""
    from meshrun.parallel.layout import build_layout
    from meshrun.plan.measure import Collectives, PeakMemory, prime_optimizer_state
    from meshrun.train.simulate import rank_usage
    from meshrun.train.simulate_pipeline import module_hooks_allowed
    from meshrun.train.step import layout_step

    layout = _layout(name, hf_dir)
    model = _model(name, hf_dir)
    _balanced_routes(model)
    built = build_layout(model, layout, device=torch.device("cpu"), seed=0)
    optimizers = [_optimizer(part) for part in built.parts]
    tokens = torch.zeros(layout.options.batch_size, SEQ, dtype=torch.long)
    batches = iter(lambda: (tokens, tokens), None)
    if built.pipeline is not None:  # the schedule's first step infers shapes (point-to-point): not a step like the others
        layout_step(built, optimizers, batches, grad_accum=1, dtype=layout.options.dtype, grad_clip=1.0)
    prime_optimizer_state(optimizers)
    memory = PeakMemory(built.parts, optimizers, module_hooks=module_hooks_allowed(layout))
    with memory, Collectives() as comms:
        layout_step(built, optimizers, batches, grad_accum=layout.options.grad_accum, dtype=layout.options.dtype,
                    grad_clip=1.0)
    usage = rank_usage(built, optimizers, comms, peak=memory.peak)
    import torch.distributed.checkpoint as dcp

    from meshrun.checkpoint.state import TrainState, tensor_state
    from meshrun.models.lora import has_adapters

    lora = any(has_adapters(part) for part in built.parts)  # as the trainer saves a LoRA run: the adapters
    dcp.save(tensor_state(TrainState(built.parts, optimizers, [], None, adapters_only=lora)), checkpoint_id=ckpt_dir)
    return usage


def _written_per_rank(path) -> dict[int, int]:  # noqa: ANN001 - a Path
    """Tensor bytes each rank's file holds in the DCP checkpoint at `path`, from its metadata
    (meshrun's restricted reader): every chunk's size, by the file that stores it."""
    import math

    from meshrun.checkpoint.safe_load import read_metadata

    meta = read_metadata(path)
    written: dict[int, int] = {}
    for fqn, item in meta.state_dict_metadata.items():
        for chunk in getattr(item, "chunks", ()):  # tensors; plain values have none
            index = next(i for i in meta.storage_data if i.fqn == fqn and tuple(i.offset) == tuple(chunk.offsets))
            rank = int(meta.storage_data[index].relative_path.split("_")[2])  # __<rank>_0.distcp
            written[rank] = written.get(rank, 0) + math.prod(chunk.sizes) * item.properties.dtype.itemsize
    return written


def _state(peak: dict) -> tuple:
    return tuple(peak[key] for key in PEAK_STATE)


def _usage(rank, peak: bool = True) -> tuple:  # noqa: ANN001 - a RankSimulation
    return rank.params, rank.grads, rank.optim, rank.collectives, rank.checkpoint, _state(rank.peak) if peak else None


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_simulated_rank_holds_and_sends_what_the_real_rank_does(name, tmp_path):
    from meshrun.testing.harness import _context
    from meshrun.train.simulate import representative_ranks, simulate_rank_isolated

    hf_dir = _hf_dir(name, tmp_path)
    layout = _layout(name, hf_dir)
    # a launch of its own: a process that built other layouts before may skip a collective a fresh
    # one issues (measured: TP's first output all-gather), and a simulated rank is a fresh world
    real = run_distributed(_real_rank, world_size=layout.world_size, args=(name, str(tmp_path), hf_dir), timeout=180,
                           env={"OMP_NUM_THREADS": "1"})
    chosen = representative_ranks(layout)
    peaks = {}
    for rank in chosen:
        # a child of the harness's forkserver: a clean torch, as a rank of a real launch has
        sim = simulate_rank_isolated(functools.partial(_model, name, hf_dir), layout, rank, build_optimizer=_optimizer, seq_len=SEQ,
                                     dtype=layout.options.dtype, grad_accum=layout.options.grad_accum,
                                     context=_context())
        got = real[rank]
        assert (sim.params, sim.grads, sim.optim) == (got.params, got.grads, got.optim), (name, rank, sim, got)
        assert sim.checkpoint == got.checkpoint and got.checkpoint["expected"] > 0, (name, rank, sim, got)
        assert sim.coords == got.coords, (name, rank)
        assert sim.collectives == got.collectives, (name, rank, sim.collectives, got.collectives)
        assert got.collectives, (name, rank, "a step of several ranks communicates")
        # the step's peak, measured alike (MemTracker) on the real tensors and the fake ones
        assert got.peak["total"] > got.state, (name, rank, got.peak)
        peaks[rank] = (sim.peak, got.peak)
        print(f"\n{name} rank {rank}: peak simulated {sim.peak['total']}, real {got.peak['total']} "
              f"({sim.peak['total'] / got.peak['total'] - 1:+.1%})\n  sim  {sim.peak}\n  real {got.peak}")
    for rank, (simulated, measured) in peaks.items():
        tolerance = PEAK_TOL if name in PEAK_INEXACT else PEAK_TIGHT
        assert abs(simulated["total"] - measured["total"]) <= tolerance * measured["total"], (name, rank, simulated, measured)
        if name not in PEAK_INEXACT:
            assert _state(simulated) == _state(measured), (name, rank, simulated, measured)
    others = [rank for rank in range(layout.world_size) if rank not in chosen]
    exact = name not in PEAK_INEXACT
    for rank in others:  # what the report leaves out is what it shows
        assert any(_usage(real[rank], exact) == _usage(real[rep], exact) for rep in chosen), (name, rank, real[rank])
    # what a rank's part of a checkpoint holds: the real save wrote, over all ranks, what their shares add up to
    # (DCP writes each tensor several ranks hold once, on one of them); each wrote at least its own shards
    written = _written_per_rank(tmp_path)
    expected = sum(real[rank].checkpoint["expected"] for rank in range(layout.world_size))
    assert sum(written.values()) == expected, (name, written, expected)
    assert all(written[rank] >= real[rank].checkpoint["own"] for rank in written), (name, written)


def test_representative_ranks_cover_each_stage_and_the_last_shard():
    from meshrun.train.simulate import representative_ranks

    assert representative_ranks(_layout("fsdp4")) == [0, 3]
    pp2 = resolve_layout(ParallelOptions(strategy="fsdp", dp_shard=2, pp=2, batch_size=2, seq_len=SEQ), WORLD,
                         ModelShape.from_args(ARGS))
    assert representative_ranks(pp2) == [0, 1, 2, 3]
    assert representative_ranks(_layout("hsdp2x2_grad_accum4")) == [0, 1]
    assert representative_ranks(_layout("ddp4")) == [0]


def test_meshrun_plan_simulate_reports_each_representative_rank(tmp_path):
    import json

    from conftest import EXAMPLES, meshrun

    args = ("plan", str(EXAMPLES / "configs" / "tiny.toml"), "--simulate", "--nnodes", "2", "--nproc-per-node", "4",
            "--set", "parallel.strategy=fsdp", "--set", "parallel.tp=2")
    result = meshrun(*args, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "simulated 8 ranks" in result.stdout and "all_gather over tp" in result.stdout, result.stdout
    assert "Traceback" not in result.output and "Warning" not in result.output, result.output
    data = json.loads(meshrun(*args, "--json", timeout=120, cwd=tmp_path).stdout)
    assert [r["rank"] for r in data["ranks"]] == [0, 7]
    assert data["ranks"][1]["coords"] == {"pp": 0, "dp_replicate": 0, "dp_shard": 3, "cp": 0, "tp": 1}
    kinds = {(c["kind"], c["dim"]) for c in data["ranks"][0]["collectives"]}
    assert {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"), ("all_reduce", "tp")} <= kinds, kinds
    projected = meshrun(*args, "--device", "h100", "--inter-node-gbps", "200", timeout=120, cwd=tmp_path)
    assert projected.returncode == 0, projected.output
    line = projected.stdout.strip().splitlines()[-1]
    assert line.startswith("projected on H100 SXM5 80GB (compute at 40% of 67 TFLOPS, NVLink 450 GB/s, "  # fp32
                           "inter-node 200 Gb/s per GPU): step "), line
    assert "tokens/s per GPU, MFU" in line and "tp " in line, line
    data = json.loads(meshrun(*args, "--json", "--device", "a100", "--compute-efficiency", "0.5", timeout=120,
                              cwd=tmp_path).stdout)
    assert data["projection"]["device"] == "A100 SXM4 80GB" and data["projection"]["compute_efficiency"] == 0.5
    assert data["projection"]["step_s"] >= data["projection"]["compute_s"] > 0
    assert all(r["peak"]["total"] > r["params"] + r["grads"] + r["optim"] for r in data["ranks"]), data["ranks"]
    piped = meshrun("plan", str(EXAMPLES / "configs" / "tiny.toml"), "--simulate", "--world", "4", "--set",
                    "parallel.strategy=fsdp", "--set", "parallel.pp=2", "--device", "h100", timeout=120, cwd=tmp_path)
    assert piped.returncode == 0, piped.output
    assert "send over pp: 2 x" in piped.stdout and "recv over pp: 2 x" in piped.stdout, piped.stdout
    assert "(with the pipeline bubble, +50%)" in piped.stdout, piped.stdout  # pp 2, 2 micro-batches
    tiny = str(EXAMPLES / "configs" / "tiny.toml")
    for extra, line in (
            (["--model", "8b"], "meshrun plan: error: --model: --simulate builds the config's own model; set [model] "
                                "in the config (or --set model.name=SIZE)"),
            (["--set", "launch.nproc_per_node=auto"], "meshrun plan: error: --simulate needs the world: --nnodes N "
                                                      "--nproc-per-node G (or --world N)"),
            (["--world", "2", "--device", "h1000"], "meshrun plan: error: --device 'h1000' is not a known device; "
                                                     "known: a100, h100, h200, b200"),
            (["--world", "2", "--device", "h100", "--inter-node-gbps", "0"],
             "meshrun plan: error: --inter-node-gbps must be > 0, got 0"),
            (["--world", "2", "--compare", "--json"],
             "meshrun plan: error: --compare prints a table; --json is for one layout (drop --compare)"),
            (["--world", "2", "--compute-efficiency", "0.5"],
             "meshrun plan: error: --compute-efficiency needs --device NAME: the device the projection is for"),
            (["--world", "2", "--set", "model.factory=mymodel:build"],
             "meshrun plan: error: model.factory='mymodel:build': meshrun plan knows only the built-in decoder's "
             "shapes; unset model.factory or use --model SIZE")):
        bad = meshrun("plan", tiny, "--simulate", *extra, timeout=60, cwd=tmp_path)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [line], (extra, bad.output)


def test_layouts_that_fail_only_at_size_are_refused_as_the_launch_refuses_them(tmp_path):
    """TP 16 over tiny's 4 heads: the simulation's line is the launch's (both before anything starts);
    a rank whose weights, gradients and optimizer state are over the device's memory: one line naming
    the rank and the parts."""
    from conftest import EXAMPLES, meshrun

    tiny = str(EXAMPLES / "configs" / "tiny.toml")
    sets = ("--set", "parallel.strategy=fsdp", "--set", "parallel.tp=16")
    sim = meshrun("plan", tiny, "--simulate", "--nnodes", "2", "--nproc-per-node", "8", *sets, timeout=60, cwd=tmp_path)
    launch = meshrun("train", tiny, "--nproc-per-node", "16", *sets, timeout=60, cwd=tmp_path)
    assert sim.returncode == launch.returncode == 2, (sim.output, launch.output)
    assert sim.stderr.strip().splitlines() == ["meshrun plan: error: parallel.tp=16 does not divide model.n_heads=4; "
                                               "valid: 1, 2"], sim.output
    assert launch.stderr.strip().splitlines()[-1].split(": error: ")[1] == sim.stderr.strip().split(": error: ")[1]
    over = meshrun("plan", tiny, "--simulate", "--world", "2", "--device", "h100", "--device-memory", "0.001",
                   timeout=120, cwd=tmp_path)
    assert over.returncode == 2, over.output
    last = over.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith("meshrun plan: error: rank 0 of ddp: dp_replicate 2 (world 2) holds "), last
    assert "of weights, gradients and optimizer state" in last[0] and "more than the device's 1.0 MiB; shard more" in last[0], last[0]


def test_a_lora_run_is_simulated_with_its_base_frozen(tmp_path):
    """lora.rank > 0: the adapters alone have gradients and optimizer state, and a checkpoint
    holds them alone (what the launch builds and saves)."""
    import json

    from conftest import EXAMPLES, meshrun

    runs = {}
    for rank in (0, 4):
        result = meshrun("plan", str(EXAMPLES / "configs" / "tiny.toml"), "--simulate", "--json", "--world", "2",
                         "--set", "parallel.strategy=fsdp", "--set", "parallel.dp_shard=2", "--set",
                         f"lora.rank={rank}", timeout=120, cwd=tmp_path)
        assert result.returncode == 0, result.output
        runs[rank] = json.loads(result.stdout)["ranks"][0]
    full, lora = runs[0], runs[4]
    assert lora["params"] > full["params"] and 0 < lora["grads"] < full["grads"] / 10, (full, lora)
    # AdamW's two moments of the adapters, and a step count each
    assert 2 * lora["grads"] < lora["optim"] < 2 * lora["grads"] + 1024, lora
    written = lora["checkpoint"]["expected"]  # the adapters and their state (the step counts: half, on 2 ranks)
    assert lora["grads"] + lora["optim"] - 1024 < written <= lora["grads"] + lora["optim"], lora
    assert written < full["checkpoint"]["expected"] / 10, (full, lora)


def test_a_compiled_run_is_simulated_eager_and_says_so(tmp_path):
    import json

    from conftest import EXAMPLES, meshrun

    result = meshrun("plan", str(EXAMPLES / "configs" / "tiny.toml"), "--simulate", "--json", "--world", "2",
                     "--set", "parallel.strategy=fsdp", "--set", "parallel.dp_shard=2", "--set", "train.compile=true",
                     timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "train.compile=true: the step is simulated eager" in json.loads(result.stdout)["note"], result.stdout


def test_train_dry_run_is_the_simulation_of_the_launch_it_would_start(tmp_path):
    """`meshrun train CONFIG --dry-run` with the launch's flags: `meshrun plan --simulate` at that
    world, the same report; nothing launched, no run directory. Its projection flags need --dry-run."""
    from conftest import EXAMPLES, meshrun

    tiny = str(EXAMPLES / "configs" / "tiny.toml")
    sets = ("--set", "parallel.strategy=fsdp", "--set", "parallel.tp=2")
    dry = meshrun("train", tiny, "--dry-run", "--nnodes", "2", "--nproc-per-node", "4", "--max-restarts", "3", *sets,
                  "--device", "h100", timeout=120, cwd=tmp_path)
    plan = meshrun("plan", tiny, "--simulate", "--nnodes", "2", "--nproc-per-node", "4", *sets, "--device", "h100",
                   timeout=120, cwd=tmp_path)
    assert dry.returncode == plan.returncode == 0, (dry.output, plan.output)

    def report(out: str) -> list[str]:  # the simulation's own seconds differ run to run
        return [line.split(" in ")[0] if line.startswith("simulated ") else line for line in out.splitlines()]

    assert report(dry.stdout) == report(plan.stdout), (dry.stdout, plan.stdout)
    assert dry.stdout.startswith("simulated 8 ranks (fsdp: dp_shard 4 x tp 2 (world 8)"), dry.stdout
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no runs/, no logs
    refused = meshrun("train", tiny, "--device", "h100", timeout=60, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "meshrun train: error: --device needs --dry-run: it sizes a projection, not a run"], refused.output


def test_compare_simulates_the_best_layouts_and_ranks_them(tmp_path):
    """--compare: the planner's best layouts of the world, each simulated; ranked by fitting state,
    then projected tokens/s per GPU; pipeline layouts among them (no layout left "not simulated" here)."""
    from conftest import EXAMPLES, meshrun

    out = meshrun("plan", str(EXAMPLES / "configs" / "tiny.toml"), "--simulate", "--compare", "--world", "4",
                  "--device", "h100", timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0].startswith("compared 6 layouts of 4 ranks"), out.stdout
    rows = [line.split() for line in lines[2:8]]
    tokens = [float(r[-3].replace(",", "")) for r in rows]
    assert tokens == sorted(tokens, reverse=True), rows
    assert all(r[-1] == "yes" for r in rows), rows
    assert any(r[1:5] == ["dp_replicate=2", "dp_shard=1", "tp=1", "pp=2"] for r in rows), rows
    assert not any(line.startswith("not simulated:") for line in lines), out.stdout
    assert "[parallel]" in out.stdout and "Traceback" not in out.output, out.output
