"""LoRA end to end through the CLI on a tiny Hugging Face Llama under FSDP 2: adapters-only
checkpoints, both exports against peft and transformers, and SIGKILL then a bitwise resume.

The uninterrupted run (a module fixture) trains 6 steps with a checkpoint every 2. From its FSDP 2
checkpoint, `ckpt export --format peft` loads with `PeftModel.from_pretrained(base, OUT)` and
`--format hf --merge` with `from_pretrained`, both giving meshrun's logits within 1e-5; a base
whose weights changed since training is refused in one line. A second run of the same command has
its last rank SIGKILL itself while writing the step-4 checkpoint (MESHRUN_FAULT=ckpt_write:4); the
agent restarts the workers, which resume from step 2 and must end with adapters bitwise equal to
the uninterrupted run's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import meshrun, save_tiny_hf

from meshrun.cli import main as cli_main
from meshrun.errors import ConfigError

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)

STEPS = 6
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TOL = 1e-5


def _train(tmp, name: str, hf_dir, *extra: str, env: dict | None = None):
    args = ["train", "--nproc-per-node", "2", "--max-restarts", "1", "--set", f"model.hf={hf_dir}",
            "--set", "lora.rank=4", "--set", "lora.alpha=8", "--set", "parallel.strategy=fsdp",
            "--set", "parallel.dp_shard=2", "--set", f"train.steps={STEPS}", "--set", "data.seq_len=16",
            "--set", "train.batch_size=2", "--set", "train.eval_interval=0", "--set", "checkpoint.interval=2",
            "--set", "checkpoint.snapshot_interval=0", "--set", "metrics.jsonl=false",
            "--set", "metrics.tensorboard=false", "--set", "optim.lr=0.05", "--set", "optim.warmup_steps=0",
            "--set", f"train.run_dir={tmp}", "--set", f"train.name={name}", *extra]
    return meshrun(*args, timeout=200, cwd=tmp, env={**ENV, **(env or {})})


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    hf_dir = save_tiny_hf(tmp / "llama")
    result = _train(tmp, "ref", hf_dir)
    assert result.returncode == 0, result.output
    return tmp, hf_dir


def test_lora_fsdp2_checkpoint_exports_load_in_peft_and_transformers_with_meshruns_logits(ref, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from meshrun.trained.lora import lora_model
    from meshrun.trained.model_source import ModelSource, open_source

    tmp, hf_dir = ref
    ckpt = tmp / "ref" / "checkpoints" / f"step-{STEPS:08d}"
    source = open_source(ckpt)
    assert source.names and all(".lora_" in n for n in source.names), "the checkpoint holds the adapters only"
    final = torch.load(tmp / "ref" / "model.pt", weights_only=True)
    assert set(final) == set(source.names), "model.pt of a LoRA run holds the adapters only"
    adapter, merged = tmp / "adapter", tmp / "merged"
    # the CLI's own entry, in this process (peft and transformers are imported here anyway)
    assert cli_main(["ckpt", "export", str(ckpt), "--format", "peft", str(adapter)]) == 0
    assert cli_main(["ckpt", "export", str(ckpt), "--format", "hf", "--merge", str(merged)]) == 0
    capsys.readouterr()
    assert cli_main(["ckpt", "export", str(ckpt), "--format", "hf", str(tmp / "x")]) == 2
    refusal = capsys.readouterr().err.strip()
    assert "holds LoRA adapters only: --merge writes" in refusal and len(refusal.splitlines()) == 1

    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = lora_model(source)(tokens)
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        plain = base(tokens).logits
        peft_logits = PeftModel.from_pretrained(base, str(adapter)).eval()(tokens).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(tokens).logits
    assert (ours - plain).abs().max() > 100 * TOL, "the adapters change nothing: the comparison would not bite"
    assert (peft_logits - ours).abs().max() <= TOL
    assert (merged_logits - ours).abs().max() <= TOL

    # other base weights under the run's model.hf: refused in one line, never exported on them
    other = save_tiny_hf(tmp / "other", seed=1)
    moved = ModelSource(source.path, {**source.config, "model": {**source.config["model"], "hf": str(other)}},
                        source.run_dir, source.specs, source.read)
    with pytest.raises(ConfigError, match="was trained on base weights with fingerprint") as err:
        lora_model(moved)
    assert "\n" not in str(err.value)


def test_lora_fsdp2_sigkill_mid_checkpoint_then_resume_is_bitwise(ref):
    tmp, hf_dir = ref
    killed = _train(tmp, "killed", hf_dir, env={"MESHRUN_FAULT": "ckpt_write:4"})
    assert killed.returncode == 0, killed.output
    assert "resumed from" in killed.output and "step-00000002" in killed.output, killed.output[-3000:]
    want = torch.load(tmp / "ref" / "model.pt", weights_only=True)
    got = torch.load(tmp / "killed" / "model.pt", weights_only=True)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), "resume is not bitwise"
    assert any(".lora_B." in k and want[k].abs().max() > 0 for k in want), "the adapters did not train"
