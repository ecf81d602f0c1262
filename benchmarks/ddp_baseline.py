"""The guide's hand-written DDP loop in plain torch, on the same model and data as `meshrun train`.

Run by benchmarks/trainer_overhead.py under torchrun; prints rank 0's median step time.
    torchrun --nproc-per-node 2 benchmarks/ddp_baseline.py --steps 60 --batch-size 16 --seq-len 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from meshrun.data import ByteTokenizer, load_corpus_text
from meshrun.data.loader import TokenWindowDataset
from meshrun.models.factory import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = ByteTokenizer()
    tokens = torch.tensor(tokenizer.encode(load_corpus_text()), dtype=torch.int64)
    dataset = TokenWindowDataset(tokens, args.seq_len)
    model = build_model(type("M", (), {"name": "tiny"})(), tokenizer.vocab_size, seed=1337)
    model = DDP(model)
    sampler = DistributedSampler(dataset, shuffle=True, seed=1337)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    times = []
    batches = iter(loader)
    for _ in range(args.steps):
        start = time.perf_counter()
        x, y = next(batches)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        loss.item()
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"median_step_time_s={statistics.median(times[args.warmup:]):.6f}")
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
