"""meshrun.plan: memory estimates vs live tensors, layout enumeration, ranking, placements."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshrun.errors import ConfigError, ModelError
from meshrun.models.llama import Transformer
from meshrun.models.sizes import get_size
from meshrun.parallel.dims import ParallelDims
from meshrun.plan import candidates, estimate, layouts, local_shapes, placements
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


@pytest.mark.parametrize("batch_size,seq_len,ac", [(4, 64, False), (2, 128, False), (2, 64, True)])
def test_activation_estimate_tracks_what_autograd_saves(batch_size, seq_len, ac):
    """Activations are measured as the bytes autograd saves for backward (weights excluded),
    not as RSS: the estimate must be within 25% (activation checkpointing: an upper bound)."""
    args = get_size("tiny")
    model = Transformer(args, seed=0)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, args.vocab_size, (batch_size, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    measured = sum(saved.values())
    est = estimate(args, _dims(), batch_size=batch_size, seq_len=seq_len,
                   activation_checkpointing=ac).activations
    if ac:  # no checkpoint wrapper here: the estimate must only be much smaller
        assert est < 0.6 * measured
    else:
        assert 0.75 * measured <= est <= 1.25 * measured


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
