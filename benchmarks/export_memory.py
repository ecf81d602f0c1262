"""Peak memory of `ckpt export --format hf` against its largest shard, and against a whole-model export.

    python benchmarks/export_memory.py                      # ~100 MB model, FSDP 2 checkpoint; about a minute
    python benchmarks/export_memory.py --dim 768 --layers 12 --timeout 600

Trains one step of the built-in model under FSDP 2 (2 gloo processes) to get a sharded checkpoint,
then exports it in fresh processes, each importing everything first: the figure is the process's
peak RSS (VmHWM) minus its RSS just before the export: cold, and warm (after reading and writing the
smallest tensor once, which pays DCP's one-time set-up, about 12 MB, then resetting the peak). Target: under two of the largest shards (ratio < 2), and
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
import json, sys
from pathlib import Path
import safetensors.torch, torch, tokenizers  # noqa: F401 - everything export imports, before the baseline
from meshrun.checkpoint import export, export_tokenizer, model_source  # noqa: F401
from meshrun.models import export_hf, to_hf  # noqa: F401
from meshrun.config import loader  # noqa: F401
def status(key):  # VmRSS / VmHWM (peak) in bytes
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
ckpt, out, fmt, size = sys.argv[1:5]
def warm_up():  # one-time set-up only: DCP's lazy imports and planner, one small tensor, one tiny file
    source = model_source.open_source(Path(ckpt))
    name = min(source.names, key=source.nbytes)
    tensor = source.read(name)
    safetensors.torch.save_file({"t": tensor}, str(Path(out).parent / "warm.safetensors"))
    del tensor, source
def run(target):
    if fmt == "hf":
        done = export_hf.export_hf(Path(ckpt), Path(target), max_shard_size=size)
        return done["largest_shard"], done["shards"]
    export.export(Path(ckpt), Path(target), fmt="safetensors")
    return Path(target).stat().st_size, 1
if sys.argv[5] == "warm":
    warm_up()
Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak, to the RSS now
base = status("VmRSS")
largest, shards = run(out)
peak = status("VmHWM") - base
print(json.dumps({"peak": peak, "largest": largest, "shards": shards}))
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
            got = {}
            for mode in ("cold", "warm"):
                line = _run([sys.executable, "-c", MEASURE, str(ckpt), f"{out}-{mode}", fmt, size, mode],
                            args.timeout).strip().splitlines()[-1]
                got[mode] = json.loads(line)
            rows.append((fmt, size, {**got["warm"], "cold": got["cold"]["peak"], "warm": got["warm"]["peak"]}))
        model = rows[0][2]["largest"]
        print(f"model {model / 1e6:.1f} MB (FSDP 2 checkpoint, dim {args.dim}, {args.layers} layers)")
        print("peak = peak RSS - RSS before the export; cold: the process's first DCP read and safetensors write, "
              "warm: after reading and writing its smallest tensor once (DCP's one-time set-up)")
        print(f"{'export':<26} {'shards':>6} {'largest MB':>10} {'cold MB':>8} {'warm MB':>8} "
              f"{'warm/largest':>12} {'warm/model':>10}")
        for fmt, size, r in rows:
            name = "safetensors (1 file)" if fmt == "safetensors" else f"hf --max-shard-size {size}"
            print(f"{name:<26} {r['shards']:>6} {r['largest'] / 1e6:>10.1f} {r['cold'] / 1e6:>8.1f} "
                  f"{r['warm'] / 1e6:>8.1f} {r['warm'] / r['largest']:>12.2f} {r['warm'] / model:>10.2f}")


if __name__ == "__main__":
    main()
