"""The guide's pipeline-parallel line, made to train on CPU, and checked against one process.

    meshrun launch --nproc-per-node 2 examples/guide/pp_gpipe.py     # 2 stages (also 1 or 4)

The guide's quick reference says:

    pipeline(module, mb_args, split_spec=...) -> build_stage -> ScheduleGPipe(stage, n_microbatches).step(x)

Taken literally, with `step(x)` on every rank, that runs the forward pass only: a schedule
built without `loss_fn` has no loss to differentiate, so it never runs backward, every
gradient stays None, and an optimizer step changes nothing. This script runs that literal form
first and prints how many parameters got a gradient (none). The form that trains
(https://docs.pytorch.org/docs/stable/distributed.pipelining.html) is:
- `ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn)`: the last stage computes the loss per
  micro-batch and starts backward from it (gradients are scaled by 1/n_microbatches, so they
  equal the whole batch's mean loss gradient);
- the inputs go to the first stage only: `schedule.step(x)`;
- the targets go to the last stage only: `schedule.step(target=y, losses=losses)`, which fills
  `losses` with the micro-batch losses; middle stages call `schedule.step()`.
GPipe (Huang et al., arXiv:1811.06965) runs all micro-batch forwards, then all backwards.

Other changes from the guide: `meshrun.init()` and the CPU device (the guide's setup raises
without an accelerator), a seeded model so every rank traces and splits the same weights,
and the loss broadcast from the last stage so rank 0 can print it. It ends with
"pp ok ... matches one process".

指南速查里流水线并行（PP）那一行在 CPU 上能真正训练的版本，并与单进程对照。按字面照搬
（每个 rank 都 `step(x)`，调度不带 `loss_fn`）只会做前向：没有 loss 就没有反向，梯度全是 None；
脚本先跑这种写法，再跑能训练的写法（`loss_fn`，输入只给第一个阶段，目标只给最后一个阶段）。
指南的初始化在没有加速器时报错，这里改用 `meshrun.init()` 和 CPU 设备。
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

import meshrun

N_LAYERS, DIM, BATCH, MICROBATCHES, STEPS = 4, 32, 16, 4, 3


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(N_LAYERS)))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def build(env, x: torch.Tensor, *, with_loss: bool):
    """Trace and split the seeded model into world_size stages; return (stage module, schedule)."""
    torch.manual_seed(0)
    per_stage = N_LAYERS // env.world_size
    split_spec = {f"layers.{i * per_stage}": SplitPoint.BEGINNING for i in range(1, env.world_size)}
    pipe = pipeline(Model(), mb_args=(x.chunk(MICROBATCHES)[0],), split_spec=split_spec)
    stage = pipe.build_stage(env.rank, env.device)
    schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn if with_loss else None)
    return stage.submod, schedule


def main() -> None:
    env = meshrun.init()
    if N_LAYERS % env.world_size:
        raise SystemExit(f"run with a world size that divides {N_LAYERS}: 1, 2 or 4 processes")
    first, last = env.rank == 0, env.rank == env.world_size - 1
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, DIM, generator=gen).to(env.device)
    y = x.mean(-1, keepdim=True).sin().to(env.device)

    # 1. The guide, literally: step(x) on every rank, no loss_fn -> forward only.
    submod, schedule = build(env, x, with_loss=False)
    schedule.step(x)
    with_grad = sum(p.grad is not None for p in submod.parameters())
    counts = torch.tensor([with_grad, sum(1 for _ in submod.parameters())])
    dist.all_reduce(counts)
    meshrun.print0(f"guide's literal step(x) on every rank: forward only, {counts[0]} of {counts[1]} "
                   f"parameters got a gradient")

    # 2. The form that trains: loss_fn on the schedule, x on the first stage, y on the last.
    submod, schedule = build(env, x, with_loss=True)
    optimizer = torch.optim.AdamW(submod.parameters(), lr=1e-2)
    history = []
    for _ in range(STEPS):
        losses: list[torch.Tensor] = []
        if first and last:
            schedule.step(x, target=y, losses=losses)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        loss = torch.stack(losses).mean() if last else torch.zeros((), device=env.device)
        dist.broadcast(loss, src=env.world_size - 1)  # only the last stage has it; every rank joins
        history.append(loss.item())
        meshrun.print0(f"step {len(history) - 1} loss={history[-1]:.6f}")

    torch.manual_seed(0)  # the same training on one process, without a pipeline
    model = Model().to(env.device)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = []
    for _ in range(STEPS):
        ref_loss = loss_fn(model(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        reference.append(ref_loss.item())
    diff = max(abs(a - b) for a, b in zip(history, reference, strict=True))
    meshrun.print0(f"pp ok: {env.world_size} stage(s), GPipe with {MICROBATCHES} micro-batches, loss "
                   f"{history[0]:.4f} -> {history[-1]:.4f}, matches one process within {diff:.1e}")
    if diff > 1e-5:
        raise SystemExit(f"pipeline training differs from one process by {diff:.2e}")
    meshrun.shutdown()


if __name__ == "__main__":
    main()
