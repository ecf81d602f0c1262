"""`meshrun train --set model.hf=DIR` end to end through the CLI, against plain `transformers`.

Tiny models saved with save_pretrained (conftest.save_tiny_hf), on 1 and 2 processes: one process
(tied Qwen3) and FSDP 2 with its export (every other layout, and 2-D compositions on 4 ranks, run
in-process over twelve architectures in tests/distributed/test_hf_matrix.py; PP 2 through the CLI
in test_refusals_name_a_fix_and_the_fix_runs below). Each run trains STEPS steps on
the built-in corpus and logs the loss every step; the reference trains the single-process
`AutoModelForCausalLM.from_pretrained(DIR)` on the same global batches (meshrun's loader, every
data-parallel rank's rows in rank order) with meshrun's own AdamW and LR schedule, and every
logged loss must match within 1e-4. Bad `model.hf` values are one line and exit 2, before any
worker starts.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import meshrun, metrics_records, save_tiny_hf

pytestmark = pytest.mark.timeout(300)

STEPS = 5
GLOBAL_BATCH = 8
TOL = 1e-4
COMMON = ["--set", f"train.steps={STEPS}", "--set", "data.seq_len=16", "--set", "train.eval_interval=0",
          "--set", "train.eval_steps=1", "--set", "metrics.interval=1", "--set", "train.grad_clip=0",
          "--set", "optim.warmup_steps=1", "--set", "metrics.tensorboard=false"]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _train(tmp_path, name: str, hf_dir, nproc: int, *sets: str):
    dp = nproc // (2 if "parallel.tp=2" in sets or "parallel.pp=2" in sets else 1)
    args = ["train", "--set", f"model.hf={hf_dir}", "--set", f"train.run_dir={tmp_path}",
            "--set", f"train.name={name}", "--set", f"train.batch_size={GLOBAL_BATCH // dp}",
            "--nproc-per-node", str(nproc), *COMMON]
    for item in sets:
        args += ["--set", item]
    result = meshrun(*args, timeout=200, cwd=tmp_path, env=ENV)
    assert result.returncode == 0, result.output
    return tmp_path / name, dp


def _reference_losses(run_dir, dp: int) -> list[float]:
    """The transformers model trained one process on the run's global batches (its own config.toml)."""
    from transformers import AutoModelForCausalLM

    from meshrun.config import load_config
    from meshrun.data.loader import build_loaders
    from meshrun.train.optimizers import build_optimizer
    from meshrun.train.schedules import build_scheduler

    cfg = load_config(run_dir / "config.toml")
    model = AutoModelForCausalLM.from_pretrained(cfg.model.hf, dtype=torch.float32)
    loaders = [build_loaders(cfg.data, batch_size=cfg.train.batch_size, dp_rank=rank, dp_size=dp,
                             seed=cfg.train.seed, vocab_size=model.config.vocab_size)[0] for rank in range(dp)]
    iters = [iter(loader) for loader in loaders]
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    losses = []
    for _ in range(cfg.train.steps):
        rows = [next(it) for it in iters]
        inputs, targets = torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])
        loss = F.cross_entropy(model(inputs).logits.flatten(0, 1).float(), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: save_tiny_hf(root / family, family) for family in ("llama", "qwen3")}


@pytest.mark.parametrize("family, nproc, sets", [
    ("qwen3", 1, ()),
    ("llama", 2, ("parallel.strategy=fsdp",)),
], ids=["1proc_qwen3_tied", "fsdp2_llama"])
def test_train_matches_transformers(tmp_path, hf_dirs, family, nproc, sets):
    run_dir, dp = _train(tmp_path, "run", hf_dirs[family], nproc, *sets)
    got = [row["loss"] for row in metrics_records(run_dir, "train")]
    ref = _reference_losses(run_dir, dp)
    assert len(got) == STEPS, got
    diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
    print(f"{family} on {nproc}: max loss difference {diff:.1e}")
    assert diff < TOL, f"loss differs by {diff:.2e}: {got} vs {ref}"
    assert ref[-1] < ref[0], f"the reference should learn: {ref}"
    assert (run_dir / "model.pt").is_file()
    if "parallel.strategy=fsdp" in sets:  # a sharded (FSDP 2) checkpoint goes back to Hugging Face
        _export_matches_the_trained_model(tmp_path, run_dir)


def _export_matches_the_trained_model(tmp_path, run_dir):
    """`meshrun ckpt export RUN --format hf OUT` (the run's last checkpoint, in this layout's shards):
    `from_pretrained(OUT)` offline gives the logits of the trained weights (model.pt in the original
    transformers model) within 1e-5."""
    from transformers import AutoModelForCausalLM

    from meshrun.config import load_config
    from meshrun.models.hf_keys import to_hf_key

    out = tmp_path / "hf-out"
    result = meshrun("ckpt", "export", str(run_dir), "--format", "hf", str(out), timeout=120, cwd=tmp_path, env=ENV)
    assert result.returncode == 0, result.output
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    trained = AutoModelForCausalLM.from_pretrained(load_config(run_dir / "config.toml").model.hf,
                                                   dtype=torch.float32).eval()
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    trained.load_state_dict({to_hf_key(k): v for k, v in weights.items()})
    tokens = torch.randint(0, trained.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (exported(tokens).logits - trained(tokens).logits).abs().max().item()
    assert diff < 1e-5, f"exported logits differ from the trained model's by {diff:.2e}"


def _refused(tmp_path, *sets: str) -> str:
    args = ["train", "--set", f"train.run_dir={tmp_path}"]
    for item in sets:
        args += ["--set", item]
    result = meshrun(*args, timeout=60, cwd=tmp_path, env=ENV)
    assert result.returncode == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_bad_model_hf_is_one_line_and_exit_2(tmp_path, hf_dirs):
    assert "is not a directory" in _refused(tmp_path, f"model.hf={tmp_path / 'missing'}")
    unknown = tmp_path / "unknown"  # a model_type this transformers does not know
    unknown.mkdir()
    config = json.loads((hf_dirs["llama"] / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    (unknown / "model.safetensors").write_bytes((hf_dirs["llama"] / "model.safetensors").read_bytes())
    line = _refused(tmp_path, f"model.hf={unknown}", "data.seq_len=16")
    assert "no_such_arch" in line and "transformers" in line, line
    line = _refused(tmp_path, f"model.hf={hf_dirs['llama']}", "model.factory=mymodel:build")
    assert "model.factory" in line, line
    line = _refused(tmp_path, f"model.hf={hf_dirs['llama']}", "model.dim=64")
    assert "model.dim=64" in line, line


def test_refusals_name_a_fix_and_the_fix_runs(tmp_path):
    """GPT-2 (no base_model_tp_plan, a tied head), through the CLI: TP 2 and PP 2 are each refused
    before launch in one line naming the fix; PP 2 with the fix (model.tie_embeddings=false) trains,
    and its export says tie_word_embeddings false and loads with from_pretrained, logits equal."""
    import hf_zoo
    from transformers import AutoModelForCausalLM

    gpt2 = hf_zoo.save_tiny(tmp_path / "gpt2", "gpt2")
    line = _refused(tmp_path, f"model.hf={gpt2}", "data.seq_len=16", "parallel.strategy=fsdp", "parallel.dp_replicate=1",
                    "parallel.tp=2", "launch.nproc_per_node=2")
    assert "parallel.tp=2" in line and "base_model_tp_plan" in line and "parallel.dp_shard" in line, line
    line = _refused(tmp_path, f"model.hf={gpt2}", "data.seq_len=16", "parallel.pp=2", "launch.nproc_per_node=2")
    assert "parallel.pp=2" in line and "model.tie_embeddings=false" in line, line
    run_dir, _ = _train(tmp_path, "untied", gpt2, 2, "parallel.pp=2", "model.tie_embeddings=false")
    assert len(metrics_records(run_dir, "train")) == STEPS
    out = tmp_path / "hf-out"
    result = meshrun("ckpt", "export", str(run_dir), "--format", "hf", str(out), timeout=120, cwd=tmp_path, env=ENV)
    assert result.returncode == 0, result.output
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    assert not torch.equal(weights["output.weight"], weights["tok_embeddings.weight"]), "the head trained on its own"
    assert torch.equal(exported.lm_head.weight, weights["output.weight"])
    assert torch.equal(exported.transformer.wte.weight, weights["tok_embeddings.weight"])
