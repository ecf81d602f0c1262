"""Peak memory of `ckpt export --format hf` against its largest shard, and against a whole-model export.

    python benchmarks/export_memory.py                      # ~100 MB model, FSDP 2 checkpoint; about a minute
    python benchmarks/export_memory.py --dim 768 --layers 12 --timeout 600

Trains one step of the built-in model under FSDP 2 (2 gloo processes) to get a sharded checkpoint,
then exports it in fresh processes, each importing everything first: the figure is the process's
peak RSS minus its RSS after the imports. Target: under two of the largest shards (ratio < 2), and
far under the model for small shards. The baseline is `--format safetensors` (one consolidated
file: the whole model in memory) in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEASURE = r"""
import json, resource, sys
from pathlib import Path
import safetensors.torch, torch, tokenizers  # noqa: F401 - everything export imports, before the baseline
from meshrun.checkpoint import export, export_tokenizer, model_source  # noqa: F401
from meshrun.models import export_hf, to_hf  # noqa: F401
from meshrun.config import loader  # noqa: F401
def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
base = rss()
ckpt, out, fmt, size = sys.argv[1:5]
if fmt == "hf":
    done = export_hf.export_hf(Path(ckpt), Path(out), max_shard_size=size)
    largest, shards = done["largest_shard"], done["shards"]
else:
    export.export(Path(ckpt), Path(out), fmt="safetensors")
    largest, shards = Path(out).stat().st_size, 1
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"delta": peak - base, "largest": largest, "shards": shards}))
"""


def _run(cmd: list[str], timeout: float, cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512, help="model width (default 512: ~100 MB in fp32)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for each subprocess")
    args = parser.parse_args()
    meshrun = str(Path(sys.executable).parent / "meshrun")
    with tempfile.TemporaryDirectory(prefix="export-mem-") as tmp:
        work = Path(tmp)
        _run([meshrun, "train", str(REPO / "examples/configs/tiny.toml"), "--set", "train.name=big",
              "--set", f"train.run_dir={work}", "--set", "train.steps=1", "--set", "train.eval_interval=0",
              "--set", "train.eval_steps=1", "--set", "train.batch_size=2", "--set", f"model.dim={args.dim}",
              "--set", f"model.n_layers={args.layers}", "--set", "model.n_heads=8", "--set", "model.n_kv_heads=8",
              "--set", "parallel.strategy=fsdp", "--set", "parallel.dp_shard=2", "--set", "parallel.dp_replicate=1",
              "--nproc-per-node", "2"], args.timeout, cwd=work)
        ckpt = sorted((work / "big" / "checkpoints").glob("step-*"))[-1]
        rows = []
        for fmt, size in (("safetensors", "-"), ("hf", "2GB"), ("hf", "25MB"), ("hf", "10MB")):
            out = work / (f"out-{fmt}-{size}" + ("" if fmt == "hf" else ".safetensors"))
            rows.append((fmt, size, json.loads(_run([sys.executable, "-c", MEASURE, str(ckpt), str(out), fmt, size],
                                                    args.timeout).strip().splitlines()[-1])))
        model = rows[0][2]["largest"]
        print(f"model {model / 1e6:.1f} MB (FSDP 2 checkpoint, dim {args.dim}, {args.layers} layers)")
        print(f"{'export':<22} {'shards':>6} {'largest MB':>11} {'peak MB':>8} {'peak/largest':>13} {'peak/model':>11}")
        for fmt, size, r in rows:
            name = "safetensors (1 file)" if fmt == "safetensors" else f"hf --max-shard-size {size}"
            print(f"{name:<22} {r['shards']:>6} {r['largest'] / 1e6:>11.1f} {r['delta'] / 1e6:>8.1f} "
                  f"{r['delta'] / r['largest']:>13.2f} {r['delta'] / model:>11.2f}")


if __name__ == "__main__":
    main()
