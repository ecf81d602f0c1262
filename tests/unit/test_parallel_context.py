"""Context parallel in one process: torch's private names it pins, the head-tail split, RoPE at
given positions, the config's refusals and the plan's arithmetic. The ring itself runs in
tests/distributed/test_context_parallel.py and tests/e2e/test_parallel_matrix.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from meshrun.config import load_config
from meshrun.errors import ConfigError, MeshrunError, ModelError
from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel import context
from meshrun.parallel.dims import ParallelDims
from meshrun.plan.memory import candidates, estimate, layouts

pytestmark = pytest.mark.timeout(60)

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def test_torchs_private_ring_names_are_where_the_adapter_looks():
    ring = context.torch_ring()
    for name in context.PRIVATE_NAMES:
        assert hasattr(ring, name), name
    assert ring._cp_options.enable_load_balance is True  # torch's default, which its public API restores
    for op in context.CPU_OPS:
        assert hasattr(torch.ops.aten, op), op


def test_a_moved_private_name_stops_in_one_line(monkeypatch):
    monkeypatch.setattr(context, "PRIVATE_NAMES", (*context.PRIVATE_NAMES, "_moved_away"))
    with pytest.raises(MeshrunError) as info:
        context.torch_ring()
    message = str(info.value)
    assert "\n" not in message and "_moved_away" in message and torch.__version__ in message
    assert "parallel.cp=1" in message


def test_head_tail_split_is_torchs_load_balancer_order():
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )

    for cp in (1, 2, 4):
        ours = torch.cat([context.head_tail_indices(32, cp, rank) for rank in range(cp)])
        assert ours.tolist() == _HeadTailLoadBalancer(32, cp, "cpu")._generate_indices()[0].tolist(), cp
    assert context.head_tail_indices(8, 2, 0).tolist() == [0, 1, 6, 7]


def test_rope_follows_the_positions_given():
    model = Transformer(ARGS, seed=0)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(tokens, positions=torch.arange(16)), model(tokens))
    # RoPE is relative: shifting every position changes nothing, spreading them does.
    assert torch.allclose(model(tokens[:, :4], positions=torch.arange(5, 9)), model(tokens[:, :4]), atol=1e-5)
    assert not torch.allclose(model(tokens[:, :4], positions=torch.tensor([0, 1, 6, 7])), model(tokens[:, :4]))
    with pytest.raises(ModelError, match="exceeds model.max_seq_len=32"):
        model(tokens[:, :2], positions=torch.tensor([3, 32]))


def test_a_model_without_positions_is_refused_in_one_line():
    context.check_model(Transformer(ARGS, seed=0), 2)
    with pytest.raises(ModelError) as info:
        context.check_model(torch.nn.Linear(2, 2), 2)
    assert "Linear.forward takes no positions= argument" in str(info.value) and "\n" not in str(info.value)


def test_the_cpu_ring_refuses_what_it_does_not_compute():
    sdpa = context._cpu_sdpa(group=None)
    q = torch.zeros(1, 1, 4, 2)
    for kwargs in (dict(is_causal=False), dict(is_causal=True, attn_mask=torch.ones(4, 4, dtype=torch.bool)),
                   dict(is_causal=True, dropout_p=0.1)):
        with pytest.raises(ModelError, match="causal attention only") as info:
            sdpa(q, q, q, **kwargs)
        assert "\n" not in str(info.value)


def test_on_an_accelerator_the_step_is_torchs_public_context_parallel(monkeypatch):
    """No GPU here: the wiring only. torch's context manager gets the batch, the targets and the
    positions (sequence dims 1, 1, 0) as copies it may shard in place, and yields them back."""
    from types import SimpleNamespace

    import torch.distributed.tensor.experimental as experimental

    calls = []

    @contextlib.contextmanager
    def fake(mesh, *, buffers, buffer_seq_dims, no_restore_buffers):
        calls.append((mesh, buffers, buffer_seq_dims, no_restore_buffers))
        yield

    monkeypatch.setattr(experimental, "context_parallel", fake)
    mesh = SimpleNamespace(device_type="cuda", size=lambda: 2, get_local_rank=lambda: 1)
    cp = context.ContextParallel(mesh)
    inputs, targets = torch.arange(8).view(1, 8), torch.arange(1, 9).view(1, 8)
    with cp.step(inputs, targets) as (i, t, positions):
        assert torch.equal(i, inputs) and i is not inputs and torch.equal(t, targets)
        assert positions.tolist() == list(range(8))
    (got_mesh, buffers, dims, no_restore), = calls
    assert got_mesh is mesh and dims == [1, 1, 0] and all(any(b is n for n in no_restore) for b in buffers)


@pytest.mark.parametrize(("overrides", "expected"), [
    (["parallel.cp=2"], "set parallel.strategy = 'fsdp'"),
    (["parallel.strategy=fsdp", "parallel.cp=2", "data.seq_len=30"],
     "data.seq_len=30 must divide into 2 x parallel.cp = 4 equal chunks"),
    (["parallel.strategy=fsdp", "parallel.cp=2", "model.factory=pkg.mod:build"],
     "model.factory='pkg.mod:build' is not split; set parallel.cp=1"),
    (["parallel.strategy=fsdp", "parallel.cp=0"], "parallel.cp must be an integer >= 1 or -1"),
])
def test_config_refuses_cp_layouts_in_one_line(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_hf_models_pass_the_config_and_factories_do_not():
    from meshrun.parallel.rules import check_cp_model

    with pytest.raises(ConfigError, match=r"model.factory='m:f' is not split; set parallel.cp=1"):
        check_cp_model(2, factory="m:f")
    check_cp_model(1, factory="m:f")
    check_cp_model(2)


@pytest.mark.parametrize("config, expected", [
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types has sliding_attention layers"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"is_causal": False}, "is_causal=false"),
    ({"text_config": {"sliding_window": 512}}, "sliding_window=512"),
])
def test_hf_attention_the_ring_cannot_compute_is_refused_before_launch(tmp_path, config, expected):
    import json

    from meshrun.models.hf_config import check_hf_context_parallel, context_parallel_refusal

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "vocab_size": 64, **config}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        check_hf_context_parallel(str(tmp_path), 2)
    assert expected in str(info.value) and "set parallel.cp=1" in str(info.value)
    assert "\n" not in str(info.value)
    check_hf_context_parallel(str(tmp_path), 1)
    # what a Llama or a Qwen2 (its window off) writes passes
    assert context_parallel_refusal({"sliding_window": None, "attention_dropout": 0.0}) == ""
    assert context_parallel_refusal({"sliding_window": 4096, "use_sliding_window": False}) == ""
    assert context_parallel_refusal({"layer_types": ["full_attention"] * 2}) == ""


def test_compile_is_refused_with_cp():
    from meshrun.parallel.rules import check_compile

    with pytest.raises(ConfigError, match=r"train.compile must be false with parallel.cp=2"):
        check_compile(True, 1, False, cp=2)
    check_compile(False, 1, False, cp=2)


def test_config_show_resolves_the_cp_axis():
    from meshrun.cli.config import resolved

    cfg, notes = resolved(load_config(None, ["parallel.strategy=fsdp", "parallel.cp=2",
                                             "launch.nproc_per_node=4"]))
    assert (cfg.parallel.dp_shard, cfg.parallel.cp) == (2, 2)
    assert "fsdp: dp_shard 2 x cp 2 (world 4)" in notes[0]


def test_plan_counts_a_cp_ranks_tokens_and_shards_over_dp_shard_x_cp():
    fsdp4 = estimate(ARGS, ParallelDims(1, 4, 1, 1, world_size=4), batch_size=4, seq_len=32)
    cp2 = estimate(ARGS, ParallelDims(1, 2, 1, 1, world_size=4, cp=2), batch_size=4, seq_len=32)
    cp4 = estimate(ARGS, ParallelDims(1, 1, 1, 1, world_size=4, cp=4), batch_size=4, seq_len=32)
    assert fsdp4.state == cp2.state == cp4.state  # the same 4-way FSDP shards
    assert cp2.activations * 2 == fsdp4.activations == cp4.activations * 4
    assert cp2.layout == "dp_replicate=1 dp_shard=2 cp=2 tp=1 pp=1"
    found = {d.degrees["cp"] for d in layouts(ARGS, 4, seq_len=32)}
    assert found == {1, 2, 4} and {d.degrees["cp"] for d in layouts(ARGS, 4)} == {1}
    assert all(d.cp == 1 for d in layouts(ARGS, 4, seq_len=6))  # 6 does not split into 4 or 8 chunks
    assert any(d.cp == 2 and d.dp_replicate == 2 for d in layouts(ARGS, 4, seq_len=32))  # HSDP x cp
    plan = candidates(ARGS, world_size=4, batch_size=4, seq_len=32, context_parallel=True)
    assert any(e.dims.cp == 4 for e in plan.ranked) and plan.recommended.dims.cp == 1  # cp ranks as model parallelism
