"""What an in-memory snapshot costs against a training step, in one process: slots vs the state-dict path.

    python benchmarks/snapshot_cost.py                      # tiny (dim 64, 2 layers) and dim 512, 4 layers
    python benchmarks/snapshot_cost.py --dims 64 --steps 60
    python benchmarks/snapshot_cost.py --peer               # + 2 processes as 2 nodes: the peer-host copy

For each model: AdamW steps of the built-in decoder (batch 8 x 32 tokens, the tiny config's),
the median time of one step, then the median time of one snapshot through
`Snapshots._write`: the per-step path (snapshot_slots.py: one copy into a preallocated
/dev/shm slot) and the general path every snapshot took before it (snapshot_files.py: torch's
state-dict functions, then a file write), each as a ratio to the step time. The snapshot is
checked against the live state by a load into a second model (bitwise). With --peer, two
processes play two nodes (gloo, one rank each, each its own area): the snapshot with its
peer-host copy (snapshot_peer.py: the transfer overlaps the next step, waited for at the next
snapshot) against the step, and the transfer alone (waited for at once).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path


class _Loader:
    """A data position stand-in with the InfiniteLoader's state_dict interface."""

    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"epoch": 0, "consumed": self.consumed, "seed": 0}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


def _state(dim: int, n_layers: int, seed: int):
    import torch

    from meshrun.checkpoint.state import TrainState
    from meshrun.models.llama import ModelArgs, Transformer
    from meshrun.models.sizes import get_size

    args = ModelArgs(**{**vars(get_size("tiny")), "dim": dim, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2})
    model = Transformer(args, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return TrainState([model], [opt], [sched], _Loader()), args


def _step(state, args, generator) -> None:
    import torch
    import torch.nn.functional as F

    tokens = torch.randint(0, args.vocab_size, (8, 32), generator=generator)
    model, opt = state.model_parts[0], state.optimizers[0]
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state.schedulers[0].step()
    state.train_loader.consumed += 8
    state.step += 1


@contextlib.contextmanager
def _snapshots(env):
    """(area, Snapshots every step) in a fresh shared-memory directory, named as the launcher would."""
    from meshrun.checkpoint.snapshot import Snapshots

    class Cfg:
        snapshot_interval = 1

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as area:
        os.environ["MESHRUN_SNAPSHOT_DIR"] = area
        run_dir = Path(area) / "run"
        run_dir.mkdir()
        yield area, Snapshots(Cfg(), run_dir=run_dir, env=env, layout={"strategy": "ddp"})


def measure(dim: int, n_layers: int, steps: int) -> dict:
    import torch

    from meshrun.runtime.process import DistEnv

    torch.set_num_threads(1)  # as meshrun's workers run (OMP_NUM_THREADS=1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    state, args = _state(dim, n_layers, 0)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")

    step_s, slot_s, file_s = [], [], []
    with _snapshots(env) as (area, snaps):
        _step(state, args, gen)
        snaps._write(state)  # sets up the slots
        for i in range(steps):
            t0 = time.perf_counter()
            _step(state, args, gen)
            t1 = time.perf_counter()
            if i % 2:
                snaps._write(state)
                slot_s.append(time.perf_counter() - t1)
            else:
                snaps._write_file(state)
                file_s.append(time.perf_counter() - t1)
            step_s.append(t1 - t0)
        snaps._write(state)
        exact = _check(snaps, state, dim, n_layers)
    step, slot, file = (statistics.median(x) for x in (step_s, slot_s, file_s))
    mb = sum(t.numel() * t.element_size() for t in snaps.slots.sources) / 2**20
    return {"dim": dim, "layers": n_layers, "MB": mb, "step": step, "slot": slot, "file": file, "exact": exact}


def _check(snaps, state, dim: int, n_layers: int) -> bool:
    """Resume a fresh model from the newest slot: every tensor equal to the live one."""
    import torch

    from meshrun.checkpoint.snapshot_slots import read_slot

    slot = snaps.dir / ("slot-0.snap" if snaps.slots.next == 1 else "slot-1.snap")
    step, tree, _ = read_slot(slot)
    other, _ = _state(dim, n_layers, 1)
    snaps._load(other, tree)
    live = state.model_parts[0].state_dict()
    got = other.model_parts[0].state_dict()
    same = all(torch.equal(live[k], got[k]) for k in live)
    moments = [v for s in state.optimizers[0].state.values() for v in s.values()]
    loaded = [v for s in other.optimizers[0].state.values() for v in s.values()]
    same &= all(torch.equal(a, b) for a, b in zip(moments, loaded, strict=True))
    return same and step == state.step and other.optimizers[0].param_groups[0]["lr"] == \
        state.optimizers[0].param_groups[0]["lr"]


def _peer_rank(rank: int, port: int, dim: int, n_layers: int, steps: int, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    from meshrun.runtime.process import DistEnv

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    env = DistEnv(rank=rank, local_rank=0, world_size=2, local_world_size=1, device=torch.device("cpu"),
                  backend="gloo")
    state, args = _state(dim, n_layers, 0)
    gen = torch.Generator().manual_seed(rank)

    with _snapshots(env) as (area, snaps):
        _step(state, args, gen)
        snaps._write(state)  # slots and the peer ring
        step_s, snap_s, transfer_s = [], [], []
        for i in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            _step(state, args, gen)
            t1 = time.perf_counter()
            snaps._write(state)
            t2 = time.perf_counter()
            if i % 4 == 3:  # now and then: the transfer alone, waited for at once
                snaps.peers.wait()
                transfer_s.append(time.perf_counter() - t2)
            step_s.append(t1 - t0)
            snap_s.append(t2 - t1)
        snaps.finish()
        held = sorted(p.name for p in Path(area).glob("peer-rank*/*.ok"))
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"step": statistics.median(step_s), "snap": statistics.median(snap_s),
                                         "transfer": statistics.median(transfer_s), "held": held}))


def measure_peer(dim: int, n_layers: int, steps: int) -> dict:
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peer.json")
        mp.spawn(_peer_rank, args=(port, dim, n_layers, steps, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,512", help="model dims to measure (64: 2 layers, others: 4)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per model (half with each path)")
    parser.add_argument("--peer", action="store_true", help="also the peer-host copy, 2 processes as 2 nodes")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    print("| model | state | one step | snapshot, slots | ratio | snapshot, state-dict path | ratio | exact |")
    print("|---|---|---|---|---|---|---|---|")
    for dim in (int(d) for d in args.dims.split(",")):
        r = measure(dim, 2 if dim <= 64 else 4, args.steps)
        print(f"| dim {r['dim']}, {r['layers']} layers | {r['MB']:.1f} MB | {r['step'] * 1e3:.1f} ms | "
              f"{r['slot'] * 1e3:.2f} ms | {r['slot'] / r['step']:.3f} | {r['file'] * 1e3:.1f} ms | "
              f"{r['file'] / r['step']:.3f} | {r['exact']} |", flush=True)
    if args.peer:
        print("\n| model (2 processes, 2 nodes) | one step | snapshot + peer copy (overlapped) | ratio | "
              "transfer alone | peer copies held |")
        print("|---|---|---|---|---|---|")
        for dim in (int(d) for d in args.dims.split(",")):
            r = measure_peer(dim, 2 if dim <= 64 else 4, args.steps)
            print(f"| dim {dim} | {r['step'] * 1e3:.1f} ms | {r['snap'] * 1e3:.2f} ms | {r['snap'] / r['step']:.3f} | "
                  f"{r['transfer'] * 1e3:.2f} ms | {', '.join(r['held'])} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
