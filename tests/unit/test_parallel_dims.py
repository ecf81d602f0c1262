"""ParallelDims: degree arithmetic, -1 inference and one-line errors, all before any process group.

The rules themselves are meshrun.parallel.rules' (tests/unit/test_parallel_resolve.py covers each
through resolve_layout); these check that ParallelDims applies them.
"""

from __future__ import annotations

import pytest

from meshrun.errors import ConfigError
from meshrun.parallel.dims import MESH_AXES, ParallelDims


def dims(world_size: int, *, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, pp: int = 1) -> ParallelDims:
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, world_size=world_size)


@pytest.mark.parametrize(
    ("kwargs", "world", "expect"),
    [
        (dict(dp_shard=-1), 4, (1, 4, 1, 1)),
        (dict(dp_replicate=-1, tp=2), 8, (4, 1, 2, 1)),
        (dict(dp_replicate=2, dp_shard=-1, tp=2), 8, (2, 2, 2, 1)),
        (dict(dp_shard=2, tp=2, pp=-1), 8, (1, 2, 2, 2)),
        (dict(dp_replicate=-1), 1, (1, 1, 1, 1)),
        (dict(dp_replicate=2, dp_shard=2), 4, (2, 2, 1, 1)),
    ],
)
def test_minus_one_takes_the_ranks_left(kwargs, world, expect):
    d = dims(world, **kwargs)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.pp) == expect
    assert d.dp_size == expect[0] * expect[1]


def test_flags_and_description():
    d = dims(8, dp_replicate=2, dp_shard=2, tp=2)
    assert d.dp_replicate_enabled and d.dp_shard_enabled and d.fsdp_enabled and d.tp_enabled
    assert d.dp_enabled and not d.pp_enabled
    assert d.describe() == "dp_replicate 2 x dp_shard 2 x tp 2 (world 8)"
    assert dims(1).describe() == "single rank (world 1)"
    assert d.degrees == {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "pp": 1, "cp": 1}
    assert MESH_AXES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def test_from_config_reads_the_four_degrees():
    class Section:
        dp_replicate, dp_shard, tp, pp, strategy = -1, 1, 2, 1, "ddp"

    d = ParallelDims.from_config(Section(), world_size=4)
    assert (d.dp_replicate, d.tp) == (2, 2)
    Section.strategy = "fsdp"  # defaults would replicate; fsdp shards the ranks left instead
    d = ParallelDims.from_config(Section(), world_size=4)
    assert (d.dp_replicate, d.dp_shard, d.tp) == (1, 2, 2)
    Section.dp_replicate, Section.dp_shard = 2, -1  # explicit degrees are kept (HSDP)
    d = ParallelDims.from_config(Section(), world_size=8)
    assert (d.dp_replicate, d.dp_shard, d.tp) == (2, 2, 2)


def test_product_not_world_size_names_keys_and_fixes():
    with pytest.raises(ConfigError) as info:
        dims(4, dp_shard=2, tp=4)
    msg = str(info.value)
    assert "\n" not in msg
    assert "parallel.dp_shard=2" in msg and "parallel.tp=4" in msg and "world size 4" in msg
    assert "parallel.dp_shard=1" in msg and "-1" in msg  # a single-key fix, and the -1 option


def test_rest_that_does_not_divide():
    with pytest.raises(ConfigError, match=r"parallel\.dp_shard=-1 .*parallel\.tp=3 = 3 does not divide the world size 4"):
        dims(4, dp_shard=-1, tp=3)


def test_two_minus_ones_are_refused():
    with pytest.raises(ConfigError, match=r"only one of .* got -1 for dp_replicate, dp_shard"):
        dims(4, dp_replicate=-1, dp_shard=-1)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_degree_values_are_checked(bad):
    with pytest.raises(ConfigError, match=r"parallel\.tp must be an integer >= 1 or -1"):
        dims(4, tp=bad)


def test_tp_must_divide_heads_and_kv_heads():
    with pytest.raises(ConfigError) as info:
        dims(4, dp_shard=-1, tp=4).check_model(n_heads=6, n_kv_heads=6, n_layers=2)
    assert str(info.value) == "parallel.tp=4 does not divide model.n_heads=6; valid: 1, 2"
    with pytest.raises(ConfigError, match=r"parallel\.tp=4 does not divide model\.n_kv_heads=2; valid: 1, 2$"):
        dims(4, tp=4).check_model(n_heads=8, n_kv_heads=2)
    dims(4, tp=4).check_model(n_heads=8, n_kv_heads=4, n_layers=1)  # fine


def test_brief_example_message():
    with pytest.raises(ConfigError) as info:
        dims(12, dp_shard=-1, tp=3).check_model(n_heads=4, n_kv_heads=4)
    assert str(info.value) == "parallel.tp=3 does not divide model.n_heads=4; valid: 1, 2, 4"


def test_pp_beyond_layers():
    with pytest.raises(ConfigError) as info:
        dims(8, pp=8).check_model(n_layers=4)
    assert str(info.value) == ("parallel.pp=8 exceeds model.n_layers=4 (a stage needs at least one block); "
                               "valid: 1, 2, 4")


def test_check_model_args_uses_model_shapes():
    from meshrun.models.llama import ModelArgs

    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    dims(2, tp=2).check_model_args(args)
    with pytest.raises(ConfigError, match="n_kv_heads=2"):
        dims(4, tp=4).check_model_args(args)
    dims(4, tp=4).check_model_args(object())  # a user model that says nothing: nothing to check


def test_world_size_is_checked():
    with pytest.raises(ConfigError, match="world size must be an integer >= 1"):
        dims(0)


# -- the parallelize entry and the TP plan refuse bad requests before any communication ----------


def _tiny(tie: bool = False):
    from meshrun.models.llama import ModelArgs, Transformer

    return Transformer(ModelArgs(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=8,
                                 tie_embeddings=tie), seed=0)


def test_parallelize_nd_refuses_pp_and_sp_without_tp():
    import torch

    from meshrun.parallel.parallelize import parallelize_nd

    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"parallel\.pp=2: a pipeline needs parallelize_pipeline"):
        parallelize_nd(_tiny(), dims(4, dp_shard=2, pp=2), None, device=cpu)
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel=true splits over tensor-parallel ranks, "
                                          r"but parallel\.tp=1"):
        parallelize_nd(_tiny(), dims(2, dp_shard=2), None, device=cpu, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"parallel\.tp=4 does not divide model\.n_heads=2"):
        parallelize_nd(_tiny(), dims(4, tp=4), None, device=cpu)


def test_tp_refuses_models_without_the_layout_and_tied_sp():
    from torch import nn

    from meshrun.errors import ModelError
    from meshrun.parallel.tp import apply_tp

    with pytest.raises(ModelError, match="has no `layers`"):
        apply_tp(nn.Linear(2, 2), None)
    model = _tiny()
    del model.layers["0"].feed_forward.w3
    with pytest.raises(ModelError, match="block 0 of model.layers has no `feed_forward.w3`"):
        apply_tp(model, None)
    with pytest.raises(ModelError, match="tie_embeddings=true"):
        apply_tp(_tiny(tie=True), None, sequence_parallel=True)


def test_full_state_dict_and_clip_without_dtensors():
    import copy

    import torch

    from meshrun.parallel.parallelize import clip_grad_norm_, full_state_dict

    model = _tiny()
    state = full_state_dict(model)
    assert set(state) == set(model.state_dict())
    assert state["norm.weight"].data_ptr() != model.norm.weight.data_ptr()  # a copy
    model(torch.randint(0, 32, (2, 8))).square().mean().backward()
    twin = copy.deepcopy(model)  # the same gradients, clipped by torch's own function
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        b.grad = a.grad.clone()
    ours = clip_grad_norm_(model.parameters(), 0.01)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
    assert ours > 0.01 and torch.allclose(ours, theirs)  # it really clips
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad)
