"""`meshrun ckpt list|inspect|export`: look into a run's checkpoints and export a consolidated model.

    meshrun ckpt list runs/tiny                                   # every checkpoint, step, validity
    meshrun ckpt inspect runs/tiny/checkpoints/step-00000020      # layout, tensors, shapes, bytes
    meshrun ckpt export runs/tiny/checkpoints/step-00000020 --format safetensors model.safetensors
    meshrun ckpt export runs/tiny/checkpoints/step-00000020 --format hf hf/tiny   # from_pretrained(hf/tiny)
    meshrun ckpt export runs/lora/checkpoints/step-00000020 --format peft adapter  # a LoRA run's adapters
    meshrun ckpt export runs/lora/checkpoints/step-00000020 --format hf --merge hf/merged

An exported file loads into the plain (unwrapped) model with `load_state_dict`, and
`--set model.init_from=FILE` starts a new training run from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshrun.argparser import Parser
from meshrun.errors import ConfigError
from meshrun.runtime.diskfault import human_bytes

HF_SHARD_DEFAULT = "2GB"  # transformers' save_pretrained default


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="meshrun ckpt", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = parser.add_subparsers(dest="action", required=True, metavar="{list,inspect,export}")
    p = sub.add_parser("list", help="a run's checkpoints: step, validity, size, which one is latest")
    p.add_argument("run", help="run directory (runs/NAME) or its checkpoints/ directory")
    p = sub.add_parser("inspect", help="one checkpoint: step, layout it was saved with, tensors, validity")
    p.add_argument("ckpt", help="checkpoint directory, e.g. runs/NAME/checkpoints/step-00000020")
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")
    p = sub.add_parser("export", help="write the model as one consolidated file, or a Hugging Face directory")
    p.add_argument("ckpt", help="checkpoint directory (--format hf: also a run directory)")
    p.add_argument("out", help="output file, e.g. model.safetensors; --format hf: a new directory")
    p.add_argument("--format", default="safetensors", choices=("safetensors", "torch", "hf", "peft"),
                   help="safetensors (default), torch (torch.save of a state_dict), hf (a directory that "
                   "transformers' from_pretrained loads), or peft (a LoRA run's adapters: a directory that "
                   "peft's PeftModel.from_pretrained(base, OUT) loads)")
    p.add_argument("--merge", action="store_true",
                   help="--format hf of a LoRA run: its base with the adapters merged in")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help=f"--format hf only: the largest safetensors shard, e.g. {HF_SHARD_DEFAULT} (default), "
                   "500MB, 1GiB")
    p.add_argument("--force", action="store_true",
                   help="replace an existing OUT file (safetensors, torch) or an earlier export in OUT (hf)")
    return parser


def _list(run: Path) -> int:
    from meshrun.checkpoint import manifest as mf

    root = run if run.name == mf.CHECKPOINTS else mf.checkpoints_dir(run)
    if not run.exists():
        runs = sorted(p.parent.name for p in run.parent.glob("*/config.toml")) if run.parent.is_dir() else []
        near = f" (runs there: {', '.join(runs[:5])}{', ...' if len(runs) > 5 else ''})" if runs else ""
        raise ConfigError(f"{run} does not exist; give a run directory such as runs/NAME{near}")
    if not root.is_dir():
        raise ConfigError(f"{run} has no {mf.CHECKPOINTS}/ directory; give a run directory such as runs/NAME "
                          "trained with --set checkpoint.interval=N")
    latest = mf.read_latest(root)
    rows = mf.committed(root) + mf.uncommitted(root)
    if not rows:
        print(f"{root}: no checkpoints")
        return 0
    print(f"{'checkpoint':<32} {'step':>8} {'size':>10}  status")
    for path in rows:
        bad = mf.problem(path)
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        step = path.name.split("-")[1].split(".")[0].lstrip("0") or "0"
        status = "ok" if bad is None else f"INVALID: {bad}"
        mark = " (latest)" if path.name == latest else ""
        print(f"{path.name + mark:<32} {step:>8} {human_bytes(size):>10}  {status}")
    return 0


def _inspect(ckpt: Path, as_json: bool) -> int:
    from meshrun.checkpoint.export import inspect

    info = inspect(ckpt)
    if as_json:
        print(json.dumps(info, indent=1, default=str))
        return 0 if info["valid"] else 1
    layout = info["layout"]
    total = sum(t["bytes"] for t in info["tensors"])
    print(f"checkpoint  {info['path']}")
    print(f"step        {info['step']}")
    print("layout      " + ", ".join(f"{k}={v}" for k, v in layout.items()) if layout else "layout      unknown")
    if info.get("data"):
        d = info["data"]
        print(f"data        epoch {d.get('epoch')}, {d.get('consumed')} of {d.get('num_samples')} samples consumed")
    print(f"valid       {'yes' if info['valid'] else 'NO: ' + str(info['problem'])}")
    if not info["valid"]:
        print("tensors     not read: a damaged checkpoint is never parsed beyond its manifest")
        return 1
    print(f"tensors     {len(info['tensors'])}, {human_bytes(total)}")
    width = max((len(t["name"]) for t in info["tensors"]), default=10)
    for t in info["tensors"]:
        print(f"  {t['name']:<{width}}  {str(t['shape']):<16} {t['dtype']:<9} {human_bytes(t['bytes']):>10}")
    return 0 if info["valid"] else 1


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "list":
        return _list(Path(args.run))
    if args.action == "inspect":
        return _inspect(Path(args.ckpt), args.json)
    if args.format == "hf":
        return _export_hf(args)
    if args.merge:
        raise ConfigError(f"--merge: only --format hf merges a LoRA run's adapters into its base; "
                          f"--format {args.format} does not, drop the flag")
    if args.format == "peft":
        return _export_peft(args)
    if args.max_shard_size is not None:
        raise ConfigError(f"--max-shard-size {args.max_shard_size}: only --format hf writes shards; "
                          f"--format {args.format} writes one file, drop the flag")
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"{out} is a directory; --format {args.format} writes one file: give a file name")
    from meshrun.checkpoint.outputs import check_output

    check_output("OUT", out, inputs=[args.ckpt], force=args.force)
    from meshrun.checkpoint.export import export
    from meshrun.config import set_flag

    shapes = export(Path(args.ckpt), Path(args.out), fmt=args.format)
    print(f"wrote {args.out}: {len(shapes)} tensors ({args.format}); load it into the plain model with "
          "load_state_dict, or train from it with " + set_flag("model.init_from", args.out), file=sys.stderr)
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from meshrun.trained.export_hf import export_hf

    done = export_hf(Path(args.ckpt), Path(args.out), max_shard_size=args.max_shard_size or HF_SHARD_DEFAULT,
                     force=args.force, merge=args.merge)
    print(f"wrote {done['out']}: {done['tensors']} tensors in {done['shards']} shard(s), "
          f"{human_bytes(done['bytes'])}; load it with transformers.AutoModelForCausalLM.from_pretrained"
          f"({done['out']!r})", file=sys.stderr)
    return 0


def _export_peft(args: argparse.Namespace) -> int:
    if args.max_shard_size is not None:
        raise ConfigError(f"--max-shard-size {args.max_shard_size}: only --format hf writes shards; drop the flag")
    from meshrun.trained.lora import export_peft

    done = export_peft(Path(args.ckpt), Path(args.out), force=args.force)
    print(f"wrote {done['out']}: {done['tensors']} adapter tensors on {', '.join(done['targets'])}; load them with "
          f"peft.PeftModel.from_pretrained(base, {done['out']!r})", file=sys.stderr)
    return 0
