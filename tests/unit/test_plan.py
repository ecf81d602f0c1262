"""meshrun.plan: memory estimates vs live tensors, layout enumeration, ranking, placements."""

from __future__ import annotations

from math import prod

import pytest
import torch
import torch.nn.functional as F

from meshrun.errors import ConfigError, ModelError
from meshrun.models.llama import ModelArgs, Transformer
from meshrun.models.sizes import get_size
from meshrun.parallel.dims import ParallelDims
from meshrun.plan import candidates, estimate, layouts, local_shapes, placements
from meshrun.plan.measure import SavedActivations
from meshrun.plan.memory import GIB


def _dims(dp_replicate=1, dp_shard=1, tp=1, pp=1):
    return ParallelDims(dp_replicate, dp_shard, tp, pp,
                        world_size=dp_replicate * dp_shard * tp * pp)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_state_estimate_matches_live_tensors_after_adamw_step():
    """params + grads + AdamW state of the tiny model, one process: the estimate is exact (<1%)."""
    args = get_size("tiny")
    model = Transformer(args, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    optim = [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
    est = estimate(args, _dims(), batch_size=2, seq_len=32)
    assert est.params == _nbytes(params)
    assert est.grads == _nbytes(grads)
    assert abs(est.optim - _nbytes(optim)) <= 0.01 * _nbytes(optim)
    assert est.params == 4 * args.num_params()


@pytest.mark.parametrize("batch_size,seq_len,ac,kv", [(4, 64, False, 2), (2, 128, False, 4), (2, 64, True, 2)])
def test_activation_estimate_tracks_what_autograd_saves(batch_size, seq_len, ac, kv):
    """Activations are measured as the peak bytes autograd holds saved for backward (weights
    excluded; `SavedActivations`), not as RSS: the estimate is within 1% (grouped-query and
    plain attention); with activation checkpointing (no wrapper here) it must be far smaller."""
    args = ModelArgs(**{**vars(get_size("tiny")), "n_kv_heads": kv, "max_seq_len": seq_len})
    model = Transformer(args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (batch_size, seq_len))
    with SavedActivations(lambda: [*model.parameters(), *model.buffers()]) as acts:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert acts.current == 0, "backward released everything"
    est = estimate(args, _dims(), batch_size=batch_size, seq_len=seq_len,
                   activation_checkpointing=ac).activations
    if ac:
        assert est < 0.6 * acts.peak
    else:
        assert abs(est - acts.peak) <= 0.01 * acts.peak, (est, acts.peak)


def test_pipeline_activations_follow_the_schedule():
    """In-flight micro-batches: GPipe holds all of them, 1F1B at most pp - rank, interleaved
    schedules their warm-up; tp splits and loss parallel split the logits too."""
    args = get_size("tiny")
    dims = _dims(pp=2)

    def acts(**kw):
        return estimate(args, dims, batch_size=8, seq_len=32, **kw).activations

    gpipe, one_f_one_b = acts(pp_schedule="gpipe", pp_microbatches=8), acts(pp_schedule="1f1b", pp_microbatches=8)
    assert one_f_one_b < gpipe / 2  # rank 0 holds 2 of 8 micro-batches
    assert acts(pp_schedule="looped_bfs", pp_microbatches=4) == acts(pp_schedule="gpipe", pp_microbatches=4)
    assert 0 < acts(pp_schedule="interleaved_zero_bubble", pp_microbatches=4) < gpipe
    assert acts(pp_schedule="interleaved_1f1b", pp_microbatches=4) < gpipe
    tp = _dims(tp=2, dp_replicate=2)
    plain = estimate(args, tp, batch_size=8, seq_len=32).activations
    assert estimate(args, tp, batch_size=8, seq_len=32, loss_parallel=True).activations < plain
    assert estimate(args, tp, batch_size=8, seq_len=32, sequence_parallel=True).activations < plain
    with pytest.raises(ConfigError, match="parallel.pp_schedule must be one of .*, got 'zb'"):
        acts(pp_schedule="zb")


def test_sharding_divides_state():
    args = get_size("small")
    base = estimate(args, _dims(), batch_size=1, seq_len=16)
    fsdp = estimate(args, _dims(dp_shard=4), batch_size=1, seq_len=16)
    tp = estimate(args, _dims(tp=2), batch_size=1, seq_len=16)
    pp = estimate(args, _dims(pp=2), batch_size=1, seq_len=16)
    assert fsdp.params <= base.params / 4 * 1.01
    assert fsdp.fsdp_buffers > 0 and base.fsdp_buffers == 0
    assert base.params / 2 < tp.params < base.params * 0.55  # norms stay whole
    assert pp.params < base.params * 0.55
    assert tp.activations < base.activations


def test_layouts_world_4():
    found = {(d.dp_replicate, d.dp_shard, d.tp, d.pp) for d in layouts(get_size("tiny"), 4)}
    # tiny: 4 heads, 2 kv heads (tp in {1, 2}), 4 layers (pp up to 4)
    assert found == {(4, 1, 1, 1), (2, 2, 1, 1), (1, 4, 1, 1), (2, 1, 2, 1), (1, 2, 2, 1),
                     (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2), (1, 1, 1, 4)}


def test_layouts_tp_must_divide_heads():
    # small: 6 heads, 2 kv heads -> tp 3 and 6 are out; 8 layers cap pp
    for d in layouts(get_size("small"), 6):
        assert d.tp in (1, 2)
    assert all(d.pp <= 4 for d in layouts(get_size("tiny"), 8))


def test_recommendation_fits_memory_and_prefers_no_model_parallel():
    args = get_size("small")
    plan = candidates(args, world_size=4, batch_size=8, seq_len=256)
    best = plan.recommended
    assert (best.dims.tp, best.dims.pp) == (1, 1) and best.fits is None
    # a budget only tp/pp layouts meet
    limit = int(best.total * 0.8)
    plan = candidates(args, world_size=4, batch_size=8, seq_len=256, device_memory=limit)
    assert plan.recommended.fits and plan.recommended.total <= limit
    assert plan.recommended.dims.tp * plan.recommended.dims.pp > 1
    fits = [e.fits for e in plan.ranked]
    assert fits == sorted(fits, reverse=True)  # fitting layouts first


def test_placements_tp2_dp_shard2():
    args = get_size("tiny")
    dims = _dims(dp_shard=2, tp=2)
    by_name = {p.name: p for p in placements(args, dims)}
    wq = by_name["layers.0.attention.wq.weight"]
    assert wq.placements == {"dp_replicate": "Replicate()", "dp_shard": "Shard(0)", "tp": "Shard(0)"}
    assert local_shapes(wq, dims) == [(32, 128)] * 4
    wo = by_name["layers.0.attention.wo.weight"]
    assert wo.placements["tp"] == "Shard(1)"
    assert local_shapes(wo, dims) == [(64, 64)] * 4
    w2 = by_name["layers.0.feed_forward.w2.weight"]
    assert local_shapes(w2, dims) == [(64, 192)] * 4
    norm = by_name["layers.0.attention_norm.weight"]
    assert norm.placements["tp"] == "Replicate()" and local_shapes(norm, dims) == [(64,)] * 4
    # 259 vocabulary rows: tp chunks 130/129, then FSDP chunks 65/65 and 65/64 (ranks: tp inner)
    assert local_shapes(by_name["tok_embeddings.weight"], dims) == [(65, 128)] * 3 + [(64, 128)]
    assert by_name["output.weight"].placements["tp"] == "Shard(0)"


def test_placements_pp_stages():
    args = get_size("tiny")
    dims = _dims(pp=2, dp_shard=2)
    by_name = {p.name: p for p in placements(args, dims)}
    assert by_name["tok_embeddings.weight"].stages == (0,)
    assert by_name["layers.1.ffn_norm.weight"].stages == (0,)
    assert by_name["layers.2.ffn_norm.weight"].stages == (1,)
    assert by_name["output.weight"].stages == (1,)
    # ranks 0-1 are stage 0 (pp outermost)
    assert local_shapes(by_name["output.weight"], dims) == [None, None, (130, 128), (129, 128)]


def test_errors():
    with pytest.raises(ModelError, match="did you mean 'tiny'"):
        get_size("tinyy")
    with pytest.raises(ConfigError, match="world size must be an integer >= 1"):
        layouts(get_size("tiny"), 0)
    with pytest.raises(ConfigError, match="train.dtype"):
        candidates(get_size("tiny"), world_size=1, batch_size=1, seq_len=8, dtype="fp8")
    with pytest.raises(ConfigError, match="parallel.tp=4 does not divide"):
        placements(get_size("tiny"), _dims(tp=4))
    assert estimate(get_size("8b"), _dims(dp_shard=8), batch_size=1, seq_len=8192).total > GIB


def test_layouts_are_the_ones_the_resolver_accepts():
    """The table lists exactly the layouts `resolve_layout` accepts for the model (with a sequence
    length, the context-parallel ones too)."""
    import itertools

    from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout

    world = 8
    every = [d for d in itertools.product((1, 2, 4, 8), repeat=5) if prod(d) == world]
    keys = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
    for name, seq_len in (("tiny", 0), ("1b", 0), ("tiny", 16), ("tiny", 8)):  # 1b ties its embeddings: no pipeline
        args = get_size(name)
        accepted = set()
        for degrees in every:
            options = ParallelOptions(strategy="fsdp", **dict(zip(keys, degrees, strict=True)), batch_size=8,
                                      seq_len=seq_len)
            if degrees[-1] > 1 and not seq_len:
                continue  # without a sequence length the plan leaves cp out
            try:
                resolve_layout(options, world, ModelShape.from_args(args))
            except ConfigError:
                continue
            accepted.add(degrees)
        found = {tuple(d.degrees[k] for k in keys) for d in layouts(args, world, seq_len)}
        assert found == accepted, (name, seq_len)
    assert any(d.pp > 1 for d in layouts(get_size("tiny"), 4))
    assert not any(d.pp > 1 for d in layouts(get_size("1b"), 4))


def test_ring_bytes_count_the_ring_of_each_cp_rank():
    """meshrun.plan.ring: nothing without cp; K and V gathered in forward and backward (a third
    time under activation checkpointing), dK and dV passed cp times in fp32; per fullest pp rank."""
    from meshrun.models.args import ModelArgs
    from meshrun.parallel.dims import ParallelDims
    from meshrun.plan.ring import ring_bytes

    args = ModelArgs(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64)
    kv = 2 * 2 * (64 // 2) * 4 * 8  # k and v: batch 2, seq 64 / cp 2, all 4 heads (kv repeated), head_dim 8

    def ring(**degrees):
        full = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **degrees}
        return ring_bytes(args, ParallelDims(**full), batch_size=2, seq_len=64)

    assert ring(world_size=4, dp_shard=4) == 0
    assert ring(world_size=2, cp=2) == 4 * kv * (1 * 4 * 2 + 2 * 4)
    assert ring(world_size=4, cp=2, pp=2) == 2 * kv * (1 * 4 * 2 + 2 * 4)  # 2 of the 4 blocks on a rank
    assert ring(world_size=4, cp=2, tp=2) == 4 * (kv // 2) * (1 * 4 * 2 + 2 * 4)  # half the heads
    checkpointed = ring_bytes(args, ParallelDims(1, 1, 1, 1, world_size=2, cp=2), batch_size=2, seq_len=64, dtype="bf16",
                              activation_checkpointing=True)
    assert checkpointed == 4 * kv * (1 * 2 * 3 + 2 * 4)


def test_expert_plan_counts_the_experts_and_all_to_all_bytes_of_each_rank(capsys):
    from meshrun.cli.plan import main
    from meshrun.models.sizes import get_size
    from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
    from meshrun.plan.experts import expert_plan

    args = get_size("tiny-moe")  # 4 experts, top 2, every block MoE
    per_expert = 3 * args.moe_hidden * args.dim * 4
    moe_blocks = args.n_layers
    for world, ep, rows in ((2, 2, 2), (4, 2, 1), (4, 4, 1)):  # efsdp = world / ep shards each rank's experts
        dims = resolve_layout(ParallelOptions(strategy="fsdp", ep=ep), world, ModelShape.from_args(args)).dims
        plan = expert_plan(args, dims, batch_size=8, seq_len=32)
        assert plan.expert_param_bytes == moe_blocks * rows * per_expert
        slots = 8 * 32 * 2
        expected = moe_blocks * (4 * slots * args.dim * 4 + args.experts * 8) * (ep - 1) / ep
        assert plan.all_to_all_bytes == pytest.approx(expected)
    dense = resolve_layout(ParallelOptions(strategy="fsdp"), 2, ModelShape.from_args(args)).dims
    assert expert_plan(args, dense, batch_size=8, seq_len=32) is None
    assert main(["--model", "tiny-moe", "--world", "2", "--set", "parallel.strategy=fsdp", "--set",
                 "parallel.ep=2"]) == 0
    assert "expert parallel: 2 of 4 experts per ep rank" in capsys.readouterr().out
