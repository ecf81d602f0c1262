"""`meshrun ckpt export --format hf` of FSDP 2 and TP 2 checkpoints: from_pretrained offline, logits equal.

Each layout trains once (2 gloo processes, 1 step of a tiny model); the export is compared with
the run's model.pt (gathered by the trainer, a path independent of the export's DCP reads) loaded
into meshrun's own Transformer.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import meshrun_each, requires, train_tiny

pytestmark = requires("transformers")

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SMALL = ["--set", "train.steps=1", "--set", "train.eval_interval=0", "--set", "train.eval_steps=1",
         "--set", "model.dim=32", "--set", "model.ffn_hidden=64", "--set", "parallel.strategy=fsdp",
         "--set", "parallel.dp_replicate=1", "--set", "train.batch_size=4"]
LAYOUTS = {
    "fsdp2": ["--set", "parallel.dp_shard=2", "--set", "model.tie_embeddings=true"],
    "tp2": ["--set", "parallel.tp=2", "--set", "parallel.dp_shard=1", "--set", "model.tie_embeddings=false"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Both runs at once: their start-up and rendezvous waits overlap (each run is bounded by its timeout)."""
    tmp = tmp_path_factory.mktemp("hf_export")
    with ThreadPoolExecutor(len(LAYOUTS)) as pool:
        done = {name: pool.submit(train_tiny, tmp, name, *SMALL, *extra, timeout=180, env=ENV)
                for name, extra in LAYOUTS.items()}
    out = {}
    for name, future in done.items():
        result, run_dir = future.result()
        assert result.returncode == 0, f"{name}: {result.output[-3000:]}"
        out[name] = run_dir
    return out


def _reference(run_dir: Path):
    from meshrun.config.loader import config_from_dict
    from meshrun.models.from_config import model_args_from_config
    from meshrun.models.llama import Transformer
    from meshrun.trained.model_source import read_config

    state = torch.load(run_dir / "model.pt", weights_only=True)
    model_cfg = config_from_dict(read_config(run_dir / "config.toml")).model
    model = Transformer(model_args_from_config(model_cfg, state["tok_embeddings.weight"].shape[0]), seed=0)
    model.load_state_dict(state)
    return model.eval()


def _check_export(run_dir: Path, out: Path, tied: bool) -> None:
    import transformers

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] == tied
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokens = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (_reference(run_dir)(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < 1e-5, f"{run_dir.name}: exported logits differ from the run's model by {diff}"


@pytest.fixture(scope="module")
def fsdp2_cli(runs, tmp_path_factory) -> dict:
    """The CLI commands on the FSDP 2 run's last checkpoint, one after another in one process (torch
    imported once): `ckpt export --format hf` into OUT, the same export again (OUT taken), and
    `meshrun generate`."""
    ckpt = sorted((runs["fsdp2"] / "checkpoints").glob("step-*"))[-1]
    out = tmp_path_factory.mktemp("hf_export_cli") / "hf"
    export, again, generate = meshrun_each(
        ["ckpt", "export", str(ckpt), "--format", "hf", str(out), "--max-shard-size", "30KB"],
        ["ckpt", "export", str(ckpt), "--format", "hf", str(out)],
        ["generate", str(ckpt), "--prompt", "Once ", "--max-new-tokens", "30", "--temperature", "1", "--seed", "7"],
        env=ENV)
    return {"out": out, "export": export, "again": again, "generate": generate}


def test_export_hf_of_fsdp2_checkpoint(runs, fsdp2_cli):
    """Through the CLI: several shards, from_pretrained offline, logits equal; a taken OUT is refused."""
    result = fsdp2_cli["export"]
    assert result.returncode == 0, result.output[-3000:]
    _check_export(runs["fsdp2"], fsdp2_cli["out"], tied=True)
    again = fsdp2_cli["again"]
    assert again.returncode == 2 and "--force" in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_export_hf_of_tp2_checkpoint(runs, tmp_path: Path):
    """The same export function in this process (no process group), from a TP 2 checkpoint, untied."""
    from meshrun.trained.export_hf import export_hf

    ckpt = sorted((runs["tp2"] / "checkpoints").glob("step-*"))[-1]
    done = export_hf(ckpt, tmp_path / "hf", max_shard_size="30KB")
    assert done["shards"] > 2
    _check_export(runs["tp2"], tmp_path / "hf", tied=False)


def test_generate_on_the_fsdp2_run(runs, fsdp2_cli):
    """`meshrun generate` on a trained run's sharded checkpoint prints the prompt and more; the same seed
    gives the same text in another process (here: this one, from the run's model.pt)."""
    from meshrun.trained.generate import Sampler, generate_text, load

    result = fsdp2_cli["generate"]
    assert result.returncode == 0, result.output[-3000:]
    assert result.stdout.startswith("Once ") and len(result.stdout) > len("Once \n")
    here = generate_text(load(runs["fsdp2"]), "Once ", Sampler(max_new_tokens=30, temperature=1.0, seed=7))
    assert result.stdout == here + "\n"
