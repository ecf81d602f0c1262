"""Resharding: a checkpoint saved under FSDP on 4 processes resumes under other layouts and world sizes.

Each resumed run's losses must equal the uninterrupted FSDP run's within 1e-5 (the global batch
is the same, 8 windows per step, in every layout), and together with the steps before the save
it must consume exactly the reference's samples, none twice. Export and init_from close the loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLES, meshrun, train_tiny

from meshrun.checkpoint.samples import effective_samples

COMMON = ["--set", "train.steps=10", "--set", "train.eval_interval=0", "--set", "metrics.interval=1",
          "--set", "checkpoint.interval=5", "--set", "checkpoint.sample_log=true", "--set", "model.tie_embeddings=false"]
ENV = {"OMP_NUM_THREADS": "1"}
FSDP4 = ["--nproc-per-node", "4", "--set", "train.batch_size=2", "--set", "parallel.strategy=fsdp",
         "--set", "parallel.dp_shard=4", "--set", "parallel.dp_replicate=1"]
TARGETS = {
    "tp2_dp2": ["--nproc-per-node", "4", "--set", "train.batch_size=4", "--set", "parallel.strategy=fsdp",
                "--set", "parallel.tp=2", "--set", "parallel.dp_shard=2", "--set", "parallel.dp_replicate=1"],
    "pp2_dp2": ["--nproc-per-node", "4", "--set", "train.batch_size=4", "--set", "parallel.strategy=fsdp",
                "--set", "parallel.pp=2", "--set", "parallel.dp_shard=2", "--set", "parallel.dp_replicate=1"],
    "ddp2": ["--nproc-per-node", "2", "--set", "train.batch_size=4"],
    "single": ["--nproc-per-node", "1", "--set", "train.batch_size=8"],
}


def _train(tmp: Path, name: str, *args: str):
    result, run_dir = train_tiny(tmp, name, *COMMON, *args, timeout=180, env=ENV)
    assert result.returncode == 0, result.output[-4000:]
    return result, run_dir


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}  # a redone step: the last row


@pytest.fixture(scope="module")
def fsdp4(tmp_path_factory) -> Path:
    _, run_dir = _train(tmp_path_factory.mktemp("reshard"), "fsdp4", *FSDP4)
    return run_dir


@pytest.mark.parametrize("target", list(TARGETS))
def test_fsdp4_checkpoint_resumes_under_another_layout(fsdp4, tmp_path, target):
    saved = fsdp4 / "checkpoints" / "step-00000005"
    # checkpoint.interval=0: the resumed run's own checkpoints are never read (its losses and sample log are)
    result, run_dir = _train(tmp_path, target, *TARGETS[target], "--resume", str(saved),
                             "--set", "checkpoint.interval=0")
    assert "saved on 4 processes, fsdp" in result.output, result.output[-3000:]
    ref, got = _losses(fsdp4), _losses(run_dir)
    assert sorted(got) == list(range(6, 11))
    diffs = {step: abs(got[step] - ref[step]) for step in got}
    assert max(diffs.values()) < 1e-5, diffs
    before, ref_samples, after = effective_samples(fsdp4), effective_samples(fsdp4), effective_samples(run_dir)
    combined = [s for step in range(1, 6) for s in before[step]] + [s for step in range(6, 11) for s in after[step]]
    assert len(combined) == len(set(combined)), "a sample was consumed twice"
    assert sorted(combined) == sorted(s for step in ref_samples.values() for s in step)
    for step in range(6, 11):  # the same global batch at every step, split differently over the ranks
        assert sorted(after[step]) == sorted(ref_samples[step]), step


def test_export_loads_into_a_plain_model_and_init_from_starts_from_it(fsdp4, tmp_path):
    from meshrun.config import load_config
    from meshrun.models.factory import build_model

    out = tmp_path / "model.safetensors"
    result = meshrun("ckpt", "export", str(fsdp4 / "checkpoints" / "step-00000010"), "--format", "safetensors",
                     str(out), timeout=90)
    assert result.returncode == 0, result.output
    from meshrun.checkpoint.export import inspect

    info = inspect(fsdp4 / "checkpoints" / "step-00000010")  # what `meshrun ckpt inspect` prints
    assert info["valid"] and info["step"] == 10 and info["layout"]["strategy"] == "fsdp", info
    assert info["layout"]["world_size"] == 4 and info["layout"]["dp_shard"] == 4
    wq = next(t for t in info["tensors"] if t["name"] == "model.layers.0.attention.wq.weight")
    assert wq["shape"] == [64, 64] and wq["dtype"] == "float32" and wq["bytes"] == 64 * 64 * 4

    from safetensors.torch import load_file

    cfg = load_config(fsdp4 / "config.toml")
    exported, distributed = build_model(cfg.model, 259), build_model(cfg.model, 259)
    exported.load_state_dict(load_file(out))  # strict: every name and shape of the unwrapped model
    distributed.load_state_dict(torch.load(fsdp4 / "model.pt", weights_only=True))  # gathered from FSDP
    tokens = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(tokens), distributed(tokens))

    # model.init_from: the trainer loads the file (strictly) into the model it built.
    from meshrun.checkpoint.export import load_consolidated

    started = build_model(cfg.model, 259, seed=123)
    load_consolidated(started, out)
    with torch.no_grad():
        assert torch.equal(started(tokens), distributed(tokens))


# -- expert parallel: examples/configs/tiny-moe-ep2.toml (2 processes, each holding 2 of the 4 experts)

MOE_EP2 = EXAMPLES / "configs" / "tiny-moe-ep2.toml"
EP_COMMON = ["--set", "train.steps=6", "--set", "train.eval_interval=0", "--set", "metrics.interval=1",
             "--set", "checkpoint.interval=3", "--set", "checkpoint.snapshot_interval=0"]


def _train_ep(tmp: Path, name: str, *args: str, env: dict | None = None) -> tuple[str, Path]:
    result = meshrun("train", str(MOE_EP2), "--set", f"train.name={name}", "--set", f"train.run_dir={tmp}",
                     *EP_COMMON, *args, timeout=150, cwd=tmp, env={**ENV, **(env or {})})
    assert result.returncode == 0, result.output[-4000:]
    return result.output, tmp / name


@pytest.mark.timeout(240)
def test_ep2_resumes_bitwise_after_sigkill_and_reshards_to_one_process(tmp_path):
    """ep 2 killed (SIGKILL) while writing its step-6 checkpoint, restarted by the agent from step 3:
    the final weights (experts and their bias included) equal an uninterrupted run's bit for bit.
    Then its step-3 checkpoint resumes in one process (all 4 experts on one rank, the same global
    batch of 16): the losses of steps 4-6 match the ep 2 run's."""
    _, ref_dir = _train_ep(tmp_path, "ref")
    out, killed_dir = _train_ep(tmp_path, "killed", "--max-restarts", "1", env={"MESHRUN_FAULT": "ckpt_write:6"})
    assert "step-00000003 (step 3, saved on 2 processes, fsdp (dp 2, ep 2))" in out, out[-3000:]
    ref, got = (torch.load(d / "model.pt", weights_only=True) for d in (ref_dir, killed_dir))
    assert ref.keys() == got.keys() and "layers.0.feed_forward.experts.w1" in ref
    assert ref["layers.0.feed_forward.experts.w1"].shape[0] == 4  # gathered from both ep ranks
    assert not [k for k in ref if not torch.equal(ref[k], got[k])]
    out, one_dir = _train_ep(tmp_path, "one", "--nproc-per-node", "1", "--set", "parallel.ep=1",
                             "--set", "train.batch_size=16", "--resume", str(killed_dir / "checkpoints" / "step-00000003"),
                             "--set", "checkpoint.interval=0")
    assert "saved on 2 processes, fsdp (dp 2, ep 2)" in out, out[-3000:]
    ref_losses, one_losses = _losses(ref_dir), _losses(one_dir)
    assert sorted(one_losses) == [4, 5, 6]
    assert max(abs(one_losses[s] - ref_losses[s]) for s in one_losses) < 1e-5, (one_losses, ref_losses)
