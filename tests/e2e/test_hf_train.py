"""`meshrun train --set model.hf=DIR` end to end through the CLI, against plain `transformers`.

Tiny models saved with save_pretrained (conftest.save_tiny_hf), on 1 and 2 processes: one process
(tied Qwen3), context parallel 2 (Llama), expert parallel 2 (Mixtral, its experts stored one by one
as published checkpoints are) and FSDP 2 with its export (every other layout, and 2-D compositions on 4 ranks, run
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
from conftest import meshrun, meshrun_each, metrics_records, save_tiny_hf

pytestmark = pytest.mark.timeout(300)

STEPS = 5
GLOBAL_BATCH = 8
TOL = 1e-4
COMMON = ["--set", f"train.steps={STEPS}", "--set", "data.seq_len=16", "--set", "train.eval_interval=0",
          "--set", "train.eval_steps=1", "--set", "metrics.interval=1", "--set", "train.grad_clip=0",
          "--set", "optim.warmup_steps=1", "--set", "metrics.tensorboard=false"]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _train(tmp_path, name: str, hf_dir, nproc: int, *sets: str):
    dp = nproc // (2 if any(f"parallel.{dim}=2" in sets for dim in ("tp", "pp", "cp")) else 1)
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
    import hf_zoo

    root = tmp_path_factory.mktemp("hf")
    dirs = {family: save_tiny_hf(root / family, family) for family in ("llama", "qwen3")}
    dirs["gpt2"] = hf_zoo.save_tiny(root / "gpt2", "gpt2")  # no base_model_tp_plan, a tied head
    dirs["mistral"] = hf_zoo.save_tiny(root / "mistral", "mistral")  # a sliding window context parallel refuses
    dirs["mixtral"] = hf_zoo.save_tiny(root / "mixtral", "mixtral")  # experts stored one by one (converted on load)
    return dirs


# name: (family, nproc, --set items)
RUNS = {
    "1proc_qwen3_tied": ("qwen3", 1, ()),
    "fsdp2_llama": ("llama", 2, ("parallel.strategy=fsdp",)),
    "cp2_llama": ("llama", 2, ("parallel.strategy=fsdp", "parallel.cp=2")),  # one sequence over 2 ranks
    "untied": ("gpt2", 2, ("parallel.pp=2", "model.tie_embeddings=false")),  # the fix of a refusal below
    "ep2_mixtral": ("mixtral", 2, ("parallel.strategy=fsdp", "parallel.ep=2")),  # 2 of the 4 experts per rank
}
EXPORTED = ("fsdp2_llama", "untied", "cp2_llama", "ep2_mixtral")


def _refusals(tmp, dirs) -> dict[str, list[str]]:
    """The --set items of each `meshrun train` that must be refused before launch."""
    llama, gpt2 = dirs["llama"], dirs["gpt2"]
    return {
        "missing": [f"model.hf={tmp / 'missing'}"],
        "unknown": [f"model.hf={tmp / 'unknown'}", "data.seq_len=16"],  # a model_type transformers does not know
        "factory": [f"model.hf={llama}", "model.factory=mymodel:build"],
        "dim": [f"model.hf={llama}", "model.dim=64"],
        "gpt2_tp2": [f"model.hf={gpt2}", "data.seq_len=16", "parallel.strategy=fsdp", "parallel.dp_replicate=1",
                     "parallel.tp=2", "launch.nproc_per_node=2"],
        "gpt2_pp2": [f"model.hf={gpt2}", "data.seq_len=16", "parallel.pp=2", "launch.nproc_per_node=2"],
        "mistral_cp2": [f"model.hf={dirs['mistral']}", "data.seq_len=16", "parallel.strategy=fsdp", "parallel.cp=2",
                        "launch.nproc_per_node=2"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_dirs) -> dict:
    """Each run of RUNS trains once; then the CLI commands that only read or check run one after the
    other in one process (torch and transformers imported once, not per command): `meshrun ckpt
    export RUN --format hf OUT` of each EXPORTED run, and every refusal of _refusals.

    {"trained": name -> (run_dir, dp), "exported": name -> (result, OUT), "refused": name -> result}.
    """
    tmp = tmp_path_factory.mktemp("hf_runs")
    trained = {name: _train(tmp, name, hf_dirs[family], nproc, *sets) for name, (family, nproc, sets) in RUNS.items()}
    unknown = tmp / "unknown"
    unknown.mkdir()
    config = json.loads((hf_dirs["llama"] / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    (unknown / "model.safetensors").write_bytes((hf_dirs["llama"] / "model.safetensors").read_bytes())
    outs = {name: tmp / f"{name}-hf-out" for name in EXPORTED}
    refusals = _refusals(tmp, hf_dirs)
    commands = [["ckpt", "export", str(trained[name][0]), "--format", "hf", str(outs[name])] for name in EXPORTED]
    for sets in refusals.values():
        commands.append(["train", "--set", f"train.run_dir={tmp}", *[arg for item in sets for arg in ("--set", item)]])
    results = meshrun_each(*commands, timeout=180, cwd=tmp, env=ENV)
    exported = {name: (result, outs[name]) for name, result in zip(EXPORTED, results, strict=False)}
    return {"trained": trained, "exported": exported,
            "refused": dict(zip(refusals, results[len(EXPORTED):], strict=True))}


@pytest.mark.parametrize("name", ["1proc_qwen3_tied", "fsdp2_llama", "cp2_llama", "ep2_mixtral"])
def test_train_matches_transformers(runs, name):
    family, nproc, sets = RUNS[name]
    run_dir, dp = runs["trained"][name]
    got = [row["loss"] for row in metrics_records(run_dir, "train")]
    ref = _reference_losses(run_dir, dp)
    assert len(got) == STEPS, got
    diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
    print(f"{family} on {nproc}: max loss difference {diff:.1e}")
    assert diff < TOL, f"loss differs by {diff:.2e}: {got} vs {ref}"
    assert ref[-1] < ref[0], f"the reference should learn: {ref}"
    assert (run_dir / "model.pt").is_file()
    if name in EXPORTED:  # a sharded (FSDP 2, or FSDP over the cp ranks) checkpoint goes back to Hugging Face
        _export_matches_the_trained_model(run_dir, *runs["exported"][name])


def _export_matches_the_trained_model(run_dir, result, out):
    """`meshrun ckpt export RUN --format hf OUT` (the run's last checkpoint, in this layout's shards):
    `from_pretrained(OUT)` offline gives the logits of the trained weights (model.pt in the original
    transformers model) within 1e-5."""
    from transformers import AutoModelForCausalLM

    from meshrun.config import load_config
    from meshrun.models.hf_keys import to_hf_key

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


def _refused(runs, name: str) -> str:
    """The one line of the refusal `name` (_refusals), which exited 2 before any worker started."""
    result = runs["refused"][name]
    assert result.returncode == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_bad_model_hf_is_one_line_and_exit_2(runs):
    assert "is not a directory" in _refused(runs, "missing")
    line = _refused(runs, "unknown")
    assert "no_such_arch" in line and "transformers" in line, line
    line = _refused(runs, "factory")
    assert "model.factory" in line, line
    line = _refused(runs, "dim")
    assert "model.dim=64" in line, line
    line = _refused(runs, "mistral_cp2")
    assert "parallel.cp=2" in line and "sliding_window=8" in line and "set parallel.cp=1" in line, line


def test_refusals_name_a_fix_and_the_fix_runs(runs):
    """GPT-2 (no base_model_tp_plan, a tied head), through the CLI: TP 2 and PP 2 are each refused
    before launch in one line naming the fix; PP 2 with the fix (model.tie_embeddings=false) trains
    (the module's "untied" run), and its export says tie_word_embeddings false and loads with
    from_pretrained, logits equal."""
    from transformers import AutoModelForCausalLM

    line = _refused(runs, "gpt2_tp2")
    assert "parallel.tp=2" in line and "base_model_tp_plan" in line and "parallel.dp_shard" in line, line
    line = _refused(runs, "gpt2_pp2")
    assert "parallel.pp=2" in line and "model.tie_embeddings=false" in line, line
    run_dir, _ = runs["trained"]["untied"]
    result, out = runs["exported"]["untied"]
    assert len(metrics_records(run_dir, "train")) == STEPS
    assert result.returncode == 0, result.output
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    assert not torch.equal(weights["output.weight"], weights["tok_embeddings.weight"]), "the head trained on its own"
    assert torch.equal(exported.lm_head.weight, weights["output.weight"])
    assert torch.equal(exported.transformer.wte.weight, weights["tok_embeddings.weight"])
