"""The guide's "DTensor and DeviceMesh" section, runnable on CPU, with each claim checked.

    meshrun launch --nproc-per-node 2 examples/guide/dtensor_mesh.py
    meshrun launch --nproc-per-node 4 examples/guide/dtensor_mesh.py   # 4 x 2 rows each

DTensor is the language FSDP2, TP and PP speak: a global tensor described by a mesh and one
placement per mesh axis (https://docs.pytorch.org/docs/stable/distributed.tensor.html):
- Shard(dim): each rank holds a slice along `dim`;
- Replicate(): each rank holds all of it;
- Partial(): each rank holds a term of a pending sum (what a row-split matmul produces, and
  what gradients are before their reduction).
`redistribute` changes placements by inserting the matching collective, and `full_tensor()`
all-gathers the global value (differentiably).

What differs from the guide: the mesh is on `env.device.type` ("cpu" here; the guide's
"cuda" fails without a GPU), and the global tensor is seeded, so every rank starts from the same
value (distribute_tensor scatters rank 0's copy by default). Shard(0) -> Shard(1) is an
all-to-all; gloo has none, so torch logs a warning and falls back to all-gather + slice.

Each step prints "ok ..." on rank 0 and raises if a rank sees something else.

指南“看一眼 DTensor 与 DeviceMesh”一节在 CPU 上的可运行版本，逐条验证其中的说法。
指南的 `init_device_mesh("cuda", ...)` 没有 GPU 时会失败，这里把网格建在 `env.device.type`
（此处为 "cpu"）上，并给全局张量固定随机种子，使每个 rank 的起点相同；gloo 没有 all-to-all，
所以 Shard(0) -> Shard(1) 时 torch 会打印警告，改用 all-gather 加切片。
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import meshrun


def check(ok: bool, what: str) -> None:
    if not ok:  # every rank checks its own view; a failure on any rank fails the launch
        raise SystemExit(f"rank {meshrun.current().rank}: {what}: FAILED")
    meshrun.print0(f"ok {what}")


def main() -> None:
    env = meshrun.init()
    world = env.world_size
    mesh = init_device_mesh(env.device.type, (world,), mesh_dim_names=("dp",))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(env.device)

    # Shard(0): 8 global rows split over the ranks; each holds 8 / world of them.
    dx = distribute_tensor(x, mesh, [Shard(0)])
    rows = 8 // world
    check(tuple(dx.to_local().shape) == (rows, 16) and tuple(dx.shape) == (8, 16),
          f"Shard(0): global {tuple(dx.shape)}, local {tuple(dx.to_local().shape)} on each of {world} ranks")
    check(torch.equal(dx.to_local(), x[env.rank * rows:(env.rank + 1) * rows]),
          "Shard(0): rank r holds rows [r*n, (r+1)*n)")

    # full_tensor(): all-gather back to the whole value.
    check(torch.equal(dx.full_tensor(), x), "full_tensor() == the original tensor")

    # Replicate: every rank holds all of it; Shard(0) -> Replicate is an all-gather.
    rx = dx.redistribute(mesh, [Replicate()])
    check(torch.equal(rx.to_local(), x), "redistribute Shard(0) -> Replicate(): every rank holds all 8 rows")

    # Partial: each rank holds a term of a sum. Rank r contributes (r + 1) * ones.
    px = DTensor.from_local(torch.ones(world, 2, device=env.device) * (env.rank + 1), mesh, [Partial()])
    total = world * (world + 1) // 2
    check(torch.equal(px.full_tensor(), torch.full((world, 2), float(total), device=env.device)),
          f"Partial(): sum of the ranks' terms = {total} (an all-reduce)")
    sx = px.redistribute(mesh, [Shard(0)])  # Partial -> Shard is a reduce-scatter
    check(torch.equal(sx.to_local(), torch.full((1, 2), float(total), device=env.device)),
          "redistribute Partial() -> Shard(0): a reduce-scatter, one summed row per rank")

    # Shard(0) -> Shard(1): an all-to-all (on gloo torch logs a warning and all-gathers + slices).
    tx = dx.redistribute(mesh, [Shard(1)])
    cols = 16 // world
    check(torch.equal(tx.to_local(), x[:, env.rank * cols:(env.rank + 1) * cols]),
          f"redistribute Shard(0) -> Shard(1): local {tuple(tx.to_local().shape)}")

    # Ops on DTensors keep their meaning: a sum over a sharded dim becomes Partial, then exact.
    col_sums = dx.sum(dim=0)
    check(torch.allclose(col_sums.full_tensor(), x.sum(dim=0), atol=1e-6),
          f"sum over the sharded dim: placements {col_sums.placements}, full value matches")
    meshrun.print0(f"dtensor ok: world_size={world}, mesh {tuple(mesh.mesh.shape)} {mesh.mesh_dim_names}")
    meshrun.shutdown()


if __name__ == "__main__":
    main()
