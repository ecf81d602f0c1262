"""`meshrun.plan.project`: the projected step of a simulated layout, term by term, checked by hand."""

from __future__ import annotations

import pytest

from meshrun.errors import ConfigError
from meshrun.parallel.dims import ParallelDims
from meshrun.plan.project import DEVICES, group_span, project, wire_bytes
from meshrun.train.simulate import CollectiveUse, RankSimulation, Simulation


class _Options:
    batch_size = 2
    grad_accum = 1


def _dims(**degrees) -> ParallelDims:
    full = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1, **degrees}
    world = full["dp_replicate"] * full["dp_shard"] * full["tp"] * full["pp"] * full["cp"]
    return ParallelDims(world_size=world, **full)


class _Layout:
    def __init__(self, pipeline=None, **degrees):  # noqa: ANN001 - a ResolvedPipeline
        self.dims = _dims(**degrees)
        self.options = _Options()
        self.pipeline = pipeline


def _sim(layout, *uses: CollectiveUse) -> Simulation:
    return Simulation(layout, [RankSimulation(0, {}, 0, 0, 0, tuple(uses))], 0.0)


def test_ring_bytes_per_kind():
    assert wire_bytes("all_gather", 100, 4) == 300  # the three other shards come in, ours goes round
    assert wire_bytes("reduce_scatter", 400, 4) == 300
    assert wire_bytes("all_reduce", 400, 4) == 600
    assert wire_bytes("all_to_all", 400, 4) == 300
    assert wire_bytes("send", 400, 2) == 400
    assert wire_bytes("all_reduce", 400, 1) == 0


def test_group_span_tells_which_groups_cross_nodes():
    dims = _dims(dp_replicate=2, dp_shard=4, tp=8)  # 64 ranks, tp fastest
    assert group_span("tp", dims) == 8  # ranks 0..7: one node of 8
    assert group_span("dp_shard", dims) == 25  # 0, 8, 16, 24: four nodes
    assert group_span("dp", dims) == 57
    assert group_span("world", dims) == 64
    experts = ParallelDims(world_size=64, dp_replicate=2, dp_shard=4, tp=8, pp=1, cp=1, ep=2)  # dp_shard = efsdp x ep
    assert group_span("ep", experts) == 9  # 0, 8: neighbouring dp_shard ranks, two nodes
    assert group_span("efsdp", experts) == 17  # 0, 16: every ep-th dp_shard rank


def test_compute_bound_fsdp_step_by_hand():
    layout = _Layout(dp_shard=8)
    # 8 ranks x 2 x 1024 tokens; 1 GFLOP per token; 1 GiB all-gathered per rank, in one node
    sim = _sim(layout, CollectiveUse("all_gather", "dp_shard", 10, 2**30))
    p = project(sim, flops_per_token=10**9, seq_len=1024, nproc_per_node=8, device_name="h100", efficiency=0.5)
    compute = 2 * 1024 * 10**9 / (989e12 * 0.5)
    assert p.compute_s == pytest.approx(compute)
    assert p.comm_s["dp_shard"] == pytest.approx(7 * 2**30 / 450e9)
    assert p.exposed_s == pytest.approx(max(0.0, 7 * 2**30 / 450e9 - compute))  # FSDP's traffic overlaps
    assert p.tokens_per_s_per_gpu == pytest.approx(2 * 1024 / p.step_s)
    assert p.mfu == pytest.approx(10**9 * p.tokens_per_s_per_gpu / 989e12)


def test_a_pipeline_adds_its_bubble_to_the_compute_and_its_sends_to_the_step():
    from meshrun.parallel.rules_pp import resolve_pipeline

    def pipeline(schedule: str, per_rank: int):
        return resolve_pipeline(pp=4, schedule=schedule, stages_per_rank=per_rank, split_points="", n_layers=16,
                                batch_size=8, microbatches=8)

    flat = project(_sim(_Layout(pp=4)), flops_per_token=10**9, seq_len=1024, nproc_per_node=8)  # no schedule: no bubble
    uses = (CollectiveUse("send", "pp", 16, 2**20), CollectiveUse("recv", "pp", 16, 2**20))
    for schedule, per_rank, bubble in (("1f1b", 1, 3 / 8), ("interleaved_1f1b", 2, 3 / 16)):
        layout = _Layout(pp=4, pipeline=pipeline(schedule, per_rank))
        p = project(_sim(layout, *uses), flops_per_token=10**9, seq_len=1024, nproc_per_node=8)
        assert p.bubble == pytest.approx(bubble)
        assert p.compute_s == pytest.approx(flat.compute_s * (1 + bubble))
        assert p.comm_s["pp"] == pytest.approx(2 * 2**20 / 450e9)  # the sends' and the receives' bytes, once each
        assert p.step_s == pytest.approx(p.compute_s + p.comm_s["pp"])  # not overlapped
        assert f"(with the pipeline bubble, +{bubble:.0%})" in p.describe()
    assert flat.bubble == 0 and "bubble" not in flat.describe()


def test_tp_traffic_adds_and_inter_node_groups_use_the_network():
    layout = _Layout(dp_shard=2, tp=8)
    uses = (CollectiveUse("all_reduce", "tp", 4, 10**9), CollectiveUse("reduce_scatter", "dp_shard", 1, 10**9))
    p = project(_sim(layout, *uses), flops_per_token=10**6, seq_len=1024, nproc_per_node=8, device_name="h100",
                inter_node_gbps=400, activation_checkpointing=True)
    assert p.comm_s["tp"] == pytest.approx(2 * 10**9 * 7 / 8 / 450e9)  # within a node: NVLink
    assert p.comm_s["dp_shard"] == pytest.approx(10**9 / 2 / 50e9)  # dp_shard spans 2 nodes: 400 Gb/s = 50 GB/s
    assert p.compute_s == pytest.approx(2 * 1024 * 10**6 * 4 / 3 / 8 / (989e12 * 0.4))  # 16 ranks share 2 rows
    assert p.exposed_s == pytest.approx(p.comm_s["tp"] + p.comm_s["dp_shard"] - p.compute_s)
    assert p.step_s == pytest.approx(p.compute_s + p.exposed_s)


def test_bad_projection_inputs_are_one_line():
    layout = _Layout(dp_shard=2)
    with pytest.raises(ConfigError, match=r"^--device 'h1000' is not a known device; known: a100, h100, h200, b200$"):
        project(_sim(layout), flops_per_token=1, seq_len=1, nproc_per_node=2, device_name="h1000")
    with pytest.raises(ConfigError, match=r"--compute-efficiency must be in \(0, 1\], got 1.5"):
        project(_sim(layout), flops_per_token=1, seq_len=1, nproc_per_node=2, efficiency=1.5)
    assert set(DEVICES) == {"a100", "h100", "h200", "b200"}
