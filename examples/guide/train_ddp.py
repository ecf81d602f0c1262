"""The guide's first complete example (DDP, single node) made portable through meshrun.

    meshrun launch --nproc-per-node 4 examples/guide/train_ddp.py   # 4 gloo processes on CPU, or 4 GPUs
    python examples/guide/train_ddp.py                              # one process, same code

What meshrun changes from the guide: `meshrun.init()` picks the device and backend (the
guide's `get_default_backend_for_device(acc)` raises on CPU), `device_ids` is passed only on
accelerators (on CPU it must be omitted), the dataset is seeded so every rank sees the same
data before the sampler splits it, and teardown is clean.

指南第一个完整例子（单机 DDP）经 meshrun 改写的版本：同一份代码可以单进程运行，也可以用
meshrun launch 起多个进程，CPU、GPU 都能跑。指南的原代码在 CPU 上会失败：没有加速器时
`get_default_backend_for_device(acc)` 报错，`device_ids=[local_rank]` 在 CPU 上也必须省略；
这里由 `meshrun.init()` 选择设备和后端，数据集固定随机种子，结束时干净地收尾。
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import meshrun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", default="ckpt.pth", help="rank 0 saves the weights here ('' = don't)")
    args = parser.parse_args()

    # ① join the process group; one device per process (CPU when there is no accelerator)
    env = meshrun.init()
    torch.manual_seed(0)

    # ② model on the device, wrapped in DDP (rank 0's initial weights are broadcast)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 2)).to(env.device)
    model = DDP(model, device_ids=env.device_ids)

    # ③ data: the same seeded dataset on every rank; DistributedSampler gives disjoint slices
    gen = torch.Generator().manual_seed(1234)
    ds = TensorDataset(torch.randn(1024, 10, generator=gen), torch.randint(0, 2, (1024,), generator=gen))
    sampler = DistributedSampler(ds, num_replicas=env.world_size, rank=env.rank, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    # ④ the loop is the single-process loop; gradients are all-reduced inside backward()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # reshuffle each epoch
        for x, y in loader:
            x, y = x.to(env.device), y.to(env.device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
        meshrun.print0(f"epoch {epoch} loss={loss.item():.4f} (world_size={env.world_size}, {env.backend})")

    if env.is_main and args.save:
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
        torch.save(model.module.state_dict(), args.save)  # save once, without the DDP wrapper
        print(f"saved {os.path.abspath(args.save)}")
    meshrun.shutdown()


if __name__ == "__main__":
    main()
