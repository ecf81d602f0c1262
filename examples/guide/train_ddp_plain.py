"""The guide's DDP example in plain torch, unchanged but for the one fix CPU needs.

    meshrun launch --nproc-per-node 2 examples/guide/train_ddp_plain.py
    torchrun --nproc-per-node 2 examples/guide/train_ddp_plain.py      # the same

It shows that an unmodified torchrun script runs under `meshrun launch`. The fix: on CPU
`torch.accelerator.current_accelerator()` returns None, so the guide's
`dist.get_default_backend_for_device(acc)` raises; fall back to gloo and skip the GPU-only
lines (`set_device_index`, `.to(local_rank)`, `device_ids=`), which also raise on CPU.

指南的 DDP 例子，纯 torch 写法，除了 CPU 必需的一处修正外原样保留，说明未修改的 torchrun
脚本可以直接在 meshrun launch 下运行。CPU 上 `torch.accelerator.current_accelerator()` 返回 None，
指南的 `dist.get_default_backend_for_device(acc)` 因此报错；这里退回 gloo，并跳过只适用于 GPU 的
几行（`set_device_index`、`.to(local_rank)`、`device_ids=`），它们在 CPU 上同样报错。
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    # ① init the process group and bind this process's GPU (if there is one)
    acc = torch.accelerator.current_accelerator()
    dist.init_process_group(dist.get_default_backend_for_device(acc) if acc else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    if acc:
        torch.accelerator.set_device_index(local_rank)
    device = torch.device(acc.type, local_rank) if acc else torch.device("cpu")
    rank = dist.get_rank()

    # ② model on the device, wrapped in DDP
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
    model = DDP(model, device_ids=[local_rank] if acc else None)

    # ③ data: DistributedSampler gives each rank a disjoint slice
    # (seeded: the guide's unseeded randn gives every rank different data)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(1024, 10, generator=g), torch.randint(0, 2, (1024,), generator=g))
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=32, sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    # ④ the training loop
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss={loss.item():.4f}")
    if rank == 0:
        torch.save(model.module.state_dict(), os.environ.get("CKPT_PATH", "ckpt.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
