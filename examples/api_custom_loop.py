"""Your own training loop, made distributed with three meshrun calls.

    meshrun launch --nproc-per-node 2 examples/api_custom_loop.py
    python examples/api_custom_loop.py          # the same code as one process

Any map-style Dataset works; each rank gets a disjoint share that reshuffles every epoch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


def main() -> None:
    env = meshrun.init()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=gen)
    dataset = TensorDataset(x, (x.sum(dim=1, keepdim=True) > 0).float())

    model = meshrun.prepare_model(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = meshrun.prepare_dataloader(dataset, batch_size=32)
    loss_fn = nn.BCEWithLogitsLoss()

    for epoch in range(3):
        for inputs, targets in loader:
            inputs, targets = inputs.to(env.device), targets.to(env.device)
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
        meshrun.print0(f"epoch {epoch} loss={loss.item():.4f} ({len(loader)} batches per rank)")
    meshrun.shutdown()


if __name__ == "__main__":
    main()
