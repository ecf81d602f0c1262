"""The guide's tensor-parallel line on its w1/w2 MLP, runnable on CPU and checked against one process.

    meshrun launch --nproc-per-node 2 examples/guide/tp_mlp.py

    parallelize_module(m, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})

Megatron-LM's split (Shoeybi et al., arXiv:1909.08053): w1 is split by output features
(each rank computes its slice of the hidden layer, no communication), the activation is applied
to that slice, and w2 is split by input features, so each rank produces a partial sum of the
output; one all-reduce at w2's output gives every rank the full result. Forward costs one
all-reduce, backward one more (at w1's input gradient). See
https://docs.pytorch.org/docs/stable/distributed.tensor.parallel.html

What differs from the guide: the mesh is on `env.device.type` (CPU here), and the MLP and its
input are seeded identically on every rank: TP ranks must see the same input (they are one
data-parallel replica), and parallelize_module shards each rank's own copy of the weights
without broadcasting them. The script checks the output, the gradients and a training step
against the unsharded MLP and prints "tp_mlp ok ...".

指南速查里张量并行（TP）那一行（w1/w2 两层 MLP 上的 parallelize_module）在 CPU 上的可运行
版本，输出、梯度和一步训练都与不切分的 MLP 对照。指南的网格建在 "cuda" 上，没有 GPU 时会失败，
这里改用 `env.device.type`；MLP 和输入在每个 rank 上用相同的种子生成，因为 TP 的各 rank 必须
看到相同的输入，而 parallelize_module 不会广播权重。
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import meshrun

DIM, HIDDEN = 16, 64


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)))


def main() -> None:
    env = meshrun.init()
    tp_mesh = init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = MLP().to(env.device)
    model = MLP().to(env.device)
    model.load_state_dict(reference.state_dict())
    parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1)).to(env.device)

    out, ref_out = model(x), reference(x)
    forward_diff = (out - ref_out).abs().max().item()  # a plain tensor: full output on every rank
    out.pow(2).mean().backward()
    ref_out.pow(2).mean().backward()
    w1_grad = model.w1.weight.grad.full_tensor()  # gradients are DTensors, sharded like the weights
    grad_diff = (w1_grad - reference.w1.weight.grad).abs().max().item()

    for m in (model, reference):  # one optimizer step each: the sharded step is a local one
        torch.optim.AdamW(m.parameters(), lr=1e-2).step()
    with torch.no_grad():
        train_diff = (model(x) - reference(x)).abs().max().item()

    w1, w2 = model.w1.weight, model.w2.weight
    meshrun.print0(f"w1 {w1.placements} local {tuple(w1.to_local().shape)} of {tuple(w1.shape)}; "
                   f"w2 {w2.placements} local {tuple(w2.to_local().shape)} of {tuple(w2.shape)}")
    worst = max(forward_diff, grad_diff, train_diff)
    meshrun.print0(f"tp_mlp ok: world_size={env.world_size}, output, w1 gradient and trained output "
                   f"match the unsharded MLP within {worst:.1e}")
    if worst > 1e-5:
        raise SystemExit(f"tensor parallel MLP differs from the unsharded one by {worst:.2e}")
    meshrun.shutdown()


if __name__ == "__main__":
    main()
