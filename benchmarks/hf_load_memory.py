"""Peak memory per rank when `model.hf` loads a Hugging Face checkpoint under FSDP 2.

    python benchmarks/hf_load_memory.py                      # ~170 MB Llama, 2 gloo processes, ~1 min
    python benchmarks/hf_load_memory.py --hidden 256 --layers 4 --timeout 300

A Llama config (fp32) is saved with save_pretrained into a temporary directory. Then 2 ranks,
spawned by `meshrun.testing.run_distributed` (bounded by --timeout, each rank reaped by pid),
each take meshrun's path: the adapter on the meta device, `build_layout` with FSDP over both
ranks (to_empty + init_weights of this rank's shards), `load_hf_weights` (DCP +
HuggingFaceStorageReader). Per rank it prints the peak RSS growth over that whole start-up (from
the meta model to the loaded shards; Linux VmHWM, reset through /proc/self/clear_refs) next to
the safetensors size, and the ratio. Target: <= 1/2 + 0.10 of the model.

Baseline, in the same processes afterwards: the same FSDP model filled the naive way, every rank
reading the whole safetensors file (`safetensors.torch.load_file`) and copying its slices in
(`BuiltLayout.load_full_state_dict`): about the whole model per rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

MB = 2**20


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> int:
    """Reset VmHWM (the peak RSS) to the current RSS; returns the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


class _Sampler:
    """Peak growth of private (RssAnon) and file-backed mapped (RssFile) memory while in the block,
    sampled every 0.5 ms by a thread: VmHWM holds only their sum."""

    def __init__(self) -> None:
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key in self.peak:
                self.peak[key] = max(self.peak[key], _status(key) - self._base[key])
            time.sleep(0.0005)

    def __enter__(self) -> _Sampler:
        self._base = {key: _status(key) for key in self.peak}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._run_once()

    def _run_once(self) -> None:
        for key in self.peak:
            self.peak[key] = max(self.peak[key], _status(key) - self._base[key])


def _rank(hf_dir: str, tiny_dir: str, naive: bool) -> dict:
    """One way of loading on this rank, after a warm-up on a tiny model (imports cost RSS too)."""
    import gc

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from meshrun.models.hf import build_hf_model
    from meshrun.models.hf_keys import from_hf_key
    from meshrun.models.hf_load import load_hf_weights
    from meshrun.parallel.layout import build_layout
    from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout

    world = dist.get_world_size()

    def load(path: str):
        with torch.device("meta"):
            model = build_hf_model(path, seed=0)
        layout = resolve_layout(ParallelOptions(strategy="fsdp", dp_shard=world), world, ModelShape.from_model(model))
        built = build_layout(model, layout, device=torch.device("cpu"), seed=0)
        if naive:  # every rank reads the whole file, then keeps its slices
            full = {from_hf_key(k): v for k, v in load_file(Path(path) / "model.safetensors").items()}
            built.load_full_state_dict(full)
            del full
        else:
            load_hf_weights(built.parts, path)
        return built

    load(tiny_dir)
    gc.collect()
    dist.barrier()
    start = _reset_peak()
    with _Sampler() as sampled:
        t0 = time.perf_counter()
        built = load(hf_dir)
        seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - start
    part = built.parts[0]
    local = sum(p.to_local().numel() * p.element_size() for p in part.parameters())
    checksum = sum(v.to_local().double().sum().item() for v in part.state_dict().values())
    return {"rank": dist.get_rank(), "peak": peak, "anon": sampled.peak["RssAnon"], "file": sampled.peak["RssFile"],
            "local_shard": local, "seconds": seconds, "checksum": checksum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for the 2-rank run, start included")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from meshrun.testing import run_distributed

    workdir = tempfile.mkdtemp(prefix="meshrun-hf-load-")
    try:
        config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                             num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                             vocab_size=args.vocab, max_position_embeddings=256)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(workdir)
        del model
        size = sum(p.stat().st_size for p in Path(workdir).glob("*.safetensors"))
        print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
              f"safetensors {size / MB:.1f} MiB (fp32), FSDP over 2 gloo ranks")
        small = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=300, max_position_embeddings=64)
        AutoModelForCausalLM.from_config(small).save_pretrained(Path(workdir) / "tiny")
        env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        runs = {naive: run_distributed(_rank, world_size=2, args=(workdir, str(Path(workdir) / "tiny"), naive),
                                       timeout=args.timeout / 2, env=env) for naive in (False, True)}
        worst = 0.0
        for ours, base in zip(runs[False], runs[True], strict=True):
            ratio, naive = ours["anon"] / size, base["anon"] / size
            worst = max(worst, ratio)
            same = abs(ours["checksum"] - base["checksum"]) <= 1e-6 * max(1.0, abs(base["checksum"]))
            print(f"rank {ours['rank']}: meta model -> loaded shards in {ours['seconds']:.1f} s, own shard "
                  f"{ours['local_shard'] / MB:.1f} MiB{'' if same else ' | VALUES DIFFER from the baseline'}\n"
                  f"  meshrun (DCP + HuggingFaceStorageReader): private peak {ours['anon'] / MB:6.1f} MiB = "
                  f"{ratio:.3f} of the model; mapped file pages peak {ours['file'] / MB:6.1f} MiB = "
                  f"{ours['file'] / size:.3f}; VmHWM growth {ours['peak'] / MB:6.1f} MiB = {ours['peak'] / size:.3f}\n"
                  f"  baseline (every rank reads the whole file): private peak {base['anon'] / MB:6.1f} MiB = "
                  f"{naive:.3f}; mapped file pages peak {base['file'] / MB:6.1f} MiB; VmHWM growth "
                  f"{base['peak'] / MB:6.1f} MiB = {base['peak'] / size:.3f}\n"
                  f"  private peak, meshrun / baseline: {ratio / naive:.2f}")
        target = 0.5 + 0.10
        print(f"worst rank, private memory: {worst:.3f} of the model; target <= {target:.2f}: "
              f"{'met' if worst <= target else 'NOT met'} (mapped file pages are the safetensors file's page "
              "cache, shared by the ranks of a node and dropped when the reader closes the file)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
