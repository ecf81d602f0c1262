"""`meshrun ckpt export CKPT --format hf OUT`: a Hugging Face directory that from_pretrained loads offline.

    meshrun ckpt export runs/tiny/checkpoints/step-00000020 --format hf hf/tiny --max-shard-size 500MB

OUT gets config.json, model-0000i-of-0000N.safetensors shards with model.safetensors.index.json,
generation_config.json when the end-of-text id is known, and the run's tokenizer files.
It streams: shards are planned from the checkpoint's metadata, then each is read (one tensor at a
time, assembled from every rank's shards), written and dropped before the next, so the peak is one
shard plus the tensor being converted, never the model. A tensor larger than --max-shard-size
gets a shard of its own. The files are written next to OUT first and moved in at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from meshrun.errors import ConfigError
from meshrun.runtime.files import follow_umask

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = "2GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
# What an earlier export wrote; --force replaces these and leaves any other file in OUT alone.
_OURS = re.compile(r"^(model-\d{5}-of-\d{5}\.safetensors|model\.safetensors(\.index\.json)?|config\.json|"
                   r"generation_config\.json)$")


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """'2GB' (10^9), '500MB', '1GiB' (2^30), '4096' (bytes) -> bytes; one line naming the flag otherwise."""
    match = _SIZE.match(str(text))
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise ConfigError(f"{flag} {text!r}: give a size such as 2GB, 500MB, 1GiB or a byte count")
    return int(float(match.group(1)) * _UNITS[unit])


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensors in order, packed into shards of at most max_bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = []
    used = max_bytes + 1
    for name, size in sizes.items():
        if used + size > max_bytes or not shards:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def check_out(out: Path, force: bool) -> None:
    """OUT may be new or empty; an existing non-empty one only with --force."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory; --format hf writes a directory: give a new path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"{out} exists and is not empty; give a new directory, or --force to replace "
                          "an earlier export there")


def export_hf(ckpt: Path, out: Path, *, max_shard_size: str = DEFAULT_MAX_SHARD, force: bool = False,
              merge: bool = False) -> dict:
    """Write CKPT (a checkpoint, or a run directory) as a Hugging Face directory at OUT; returns a summary.
    `merge`: CKPT holds LoRA adapters (trained/lora.py): write its base with them merged in."""
    max_bytes = parse_size(max_shard_size)  # bad options and a taken OUT: one line before torch is imported
    from meshrun.checkpoint.outputs import check_output
    from meshrun.trained.model_source import open_source

    check_output("OUT", out, inputs=[ckpt], writes=[], force=force)  # never in a checkpoint or an input
    check_out(Path(out), force)
    source = open_source(Path(ckpt))
    if source.hf_dir:  # the Hugging Face directory the run started from is an input too
        check_output("OUT", out, inputs=[source.hf_dir], writes=[], force=force)
    from meshrun.trained.lora import has_adapters, merged

    if has_adapters(source) != merge:
        raise ConfigError(f"{ckpt} holds LoRA adapters only: --merge writes its base with them merged in, "
                          "--format peft the adapters" if not merge else
                          f"--merge: {ckpt} holds no LoRA adapters (its run had lora.rank=0); drop --merge")
    if merge:
        source = merged(source)
    return write_hf(source, Path(out), max_bytes=max_bytes)


def write_hf(source, out: Path, *, max_bytes: int) -> dict:
    """Write a ModelSource (trained/model_source.py) as a Hugging Face directory at OUT."""
    from meshrun.checkpoint.export_tokenizer import token_ids, write_tokenizer_files
    from meshrun.models.to_hf import plan_for

    save_file = _save_file()
    plan = plan_for(source.specs, source.config, token_ids(source.config))
    shards = plan_shards({name: source.nbytes(name) for name in plan.names}, max_bytes)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weight_map, largest = {}, 0
        for i, names in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            shard = {}
            for name in names:  # one tensor at a time into the shard being built
                shard[plan.names[name]] = plan.convert(name, source.read(name))
                weight_map[plan.names[name]] = file
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            follow_umask(tmp / file)  # safetensors creates 0600; an export is as readable as the rest
            largest = max(largest, sum(t.numel() * t.element_size() for t in shard.values()))
            del shard  # dropped before the next shard is read
        total = sum(source.nbytes(name) for name in plan.names)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(tmp / INDEX_FILE, index)
        _write_json(tmp / "config.json", plan.config)
        written = _extra_files(source, plan.config, tmp, write_tokenizer_files)
        _move_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"out": str(out), "source": str(source.path), "shards": len(shards), "tensors": len(plan.names),
            "bytes": total, "largest_shard": largest, "files": written}


def _extra_files(source, config: dict, tmp: Path, write_tokenizer_files) -> list[str]:
    """generation_config.json and tokenizer files: the HF run's own when it has them, else built here."""
    written = []
    hf_gen = Path(source.hf_dir).expanduser() / "generation_config.json" if source.hf_dir else None
    if hf_gen is not None and hf_gen.is_file():
        shutil.copyfile(hf_gen, tmp / hf_gen.name)
        written.append(hf_gen.name)
    elif config.get("eos_token_id") is not None:
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        _write_json(tmp / "generation_config.json", {**gen, "use_cache": True})
        written.append("generation_config.json")
    return written + write_tokenizer_files(source.config, tmp, config.get("max_position_embeddings"))


def _move_in(tmp: Path, out: Path) -> None:
    """Put the finished files at OUT: a rename when OUT is new; else replace only an earlier export's files."""
    if not out.exists():
        tmp.rename(out)
        return
    for old in out.iterdir():
        if old.is_file() and (_OURS.match(old.name) or (tmp / old.name).exists()):
            old.unlink()
    for new in tmp.iterdir():
        new.replace(out / new.name)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _save_file():
    from meshrun.extras import import_extra

    return import_extra("safetensors.torch", "--format hf", error=ConfigError).save_file
