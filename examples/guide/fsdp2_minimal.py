"""The guide's "FSDP2 minimal change", made runnable on CPU, and checked against one process.

    meshrun launch --nproc-per-node 2 examples/guide/fsdp2_minimal.py
    python examples/guide/fsdp2_minimal.py            # one process: FSDP over a world of 1

What differs from the guide, and why:
- `meshrun.init()` instead of the accelerator-only setup (the guide's lines raise on CPU), and
  an explicit 1-D DeviceMesh on `env.device.type`, so the same code runs on CPU and GPUs.
- Each rank takes its own slice of one seeded global batch; the guide leaves data out.
- The guide says each `fully_shard` call creates a communication group. It does not: every
  call uses the mesh's group; each call makes one *unit* that is all-gathered before its
  forward and reduce-scattered after its backward (hence bottom-up: blocks, then the root).
- Two contracts the guide states, shown to matter: the optimizer is built after sharding (an
  optimizer built before never updates the sharded parameters), and the model is called as
  `model(x)` (the all-gather is a forward pre-hook; `model.forward(x)` fails with "mixed
  torch.Tensor and DTensor").

It prints one line per step and a final "fsdp2 ok" line comparing against the same training
run on one process, without FSDP, on the whole batch.

指南“进阶一步：FSDP2 最小改造”一节在 CPU 上的可运行版本，并与单进程训练对照。指南的初始化
只适用于加速器，在 CPU 上报错，这里改用 `meshrun.init()` 和建在 `env.device.type` 上的一维网格。
脚本还验证指南的两条约定（优化器在分片之后构建；调用 `model(x)` 而不是 `model.forward(x)`），
并指出指南的一处误解：每次 `fully_shard` 调用并不创建新的通信组，用的都是网格的进程组。
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import meshrun

STEPS, GLOBAL_BATCH, DIM = 5, 16, 64


class Model(nn.Module):
    """A stack of blocks in `model.layers`, the shape the guide's loop assumes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # (B, 1): a fresh tensor, not a view (FSDP warns about views)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # after fully_shard: DTensor params
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x), y)  # model(x), not model.forward(x)
        loss.backward()  # reduce-scatters each unit's gradients
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def main() -> None:
    env = meshrun.init()
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(GLOBAL_BATCH, DIM, generator=gen)
    y_all = x_all.sum(-1, keepdim=True).sin()
    per_rank = GLOBAL_BATCH // env.world_size
    rows = slice(env.rank * per_rank, (env.rank + 1) * per_rank)
    x, y = x_all[rows].to(env.device), y_all[rows].to(env.device)

    torch.manual_seed(0)  # same initial weights everywhere (fully_shard does not broadcast)
    model = Model().to(env.device)
    mesh = init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("dp",))
    for layer in model.layers:  # bottom-up: every block is its own unit ...
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # ... then the root takes what is left (the head)

    weight = model.layers[0][0].weight  # now a DTensor, Shard(0) over the mesh
    losses = train(model, x, y)
    mean = torch.stack(losses) / env.world_size
    dist.all_reduce(mean)  # each rank's loss is on its slice; the batch loss is their mean
    for step, value in enumerate(mean.tolist()):
        meshrun.print0(f"step {step} loss={value:.6f}")

    torch.manual_seed(0)  # the same run on one process, whole batch, no FSDP
    reference = torch.stack(train(Model(), x_all, y_all))
    diff = (mean.cpu() - reference).abs().max().item()
    meshrun.print0(f"fsdp2 ok: world_size={env.world_size}, layers.0 weight local "
                   f"{tuple(weight.to_local().shape)} of {tuple(weight.shape)} {weight.placements}, "
                   f"loss {mean[0]:.4f} -> {mean[-1]:.4f}, matches one process within {diff:.1e}")
    if diff > 1e-5:
        raise SystemExit(f"FSDP2 diverged from one process by {diff:.2e}")
    meshrun.shutdown()


if __name__ == "__main__":
    main()
