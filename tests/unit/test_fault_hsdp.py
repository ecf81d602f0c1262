"""HSDP replica groups (meshrun.fault.hsdp) on 2 real gloo ranks sharding one model with FSDP2:
the heal state round trip (local shards, weights-only), the group fingerprint, and the
cross-group average applied to the gradients by the time backward returns (before clipping)."""

from __future__ import annotations

import importlib.util
import io

import pytest

from meshrun.config import load_config
from meshrun.testing import run_distributed
from meshrun.train.preflight import check_fault


def _sharded(seed: int):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 5), nn.LayerNorm(5), nn.Linear(5, 3))  # 5 rows on 2 ranks: padded
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model, optimizer, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    optimizer.zero_grad()
    model(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()


def heal_round_trip() -> tuple[bool, bool, float, float]:
    import torch
    import torch.distributed as dist

    from meshrun.fault import hsdp

    peer, peer_opt = _sharded(0)
    _step(peer, peer_opt, 10 + dist.get_rank())
    buf = io.BytesIO()  # through bytes and a weights-only read, as the heal transport does
    torch.save(hsdp.model_state(peer, peer_opt, True), buf)
    buf.seek(0)
    sent = torch.load(buf, weights_only=True)
    fresh, fresh_opt = _sharded(1)  # other weights, empty AdamW state: a restarted group
    hsdp.load_model_state(fresh, fresh_opt, sent, True)
    same_now = all(torch.equal(a.to_local(), b.to_local())
                   for a, b in zip(peer.state_dict().values(), fresh.state_dict().values(), strict=True))
    _step(peer, peer_opt, 20)  # the optimizer state came too: one more step keeps them equal
    _step(fresh, fresh_opt, 20)
    same_after = all(torch.equal(a.to_local(), b.to_local())
                     for a, b in zip(peer.state_dict().values(), fresh.state_dict().values(), strict=True))
    full = float(sum(t.full_tensor().double().sum() for t in peer.state_dict().values()))
    return same_now, same_after, hsdp.weights_sum(peer), full


def test_heal_state_round_trip_and_fingerprint():
    pytest.importorskip("torchft")
    for same_now, same_after, fingerprint, full in run_distributed(heal_round_trip, world_size=2, timeout=90):
        assert same_now, "the healed shards differ from the peer's"
        assert same_after, "the healed optimizer state differs from the peer's"
        assert fingerprint == pytest.approx(full, rel=1e-12), "the group fingerprint is not the full weights' sum"


class _HalvingManager:
    """Stands in for torchft's Manager across groups: 'averaging' with a peer whose gradient is 0."""

    def allreduce(self, tensor):
        tensor.mul_(0.5)
        return self

    def wait(self) -> None:
        pass


def grads_after_backward() -> list[bool]:
    import torch

    from meshrun.fault import hsdp

    plain, _ = _sharded(0)
    averaged, _ = _sharded(0)
    hsdp.attach(_HalvingManager(), averaged)
    for model in (plain, averaged):
        torch.manual_seed(5)
        model(torch.randn(4, 8)).square().sum().backward()
    return [torch.allclose(b.grad.to_local(), a.grad.to_local() * 0.5)
            for a, b in zip(plain.parameters(), averaged.parameters(), strict=True)]


def test_cross_group_average_is_in_the_gradients_when_backward_returns():
    pytest.importorskip("torchft")
    for same in run_distributed(grads_after_backward, world_size=2, timeout=90):
        assert same and all(same)


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs the torchft extra")
def test_fsdp_replica_groups_are_allowed():
    check_fault(load_config(None, ["fault.mode=torchft", "fault.group_size=2", "parallel.strategy=fsdp"]))
