"""`meshrun train` end to end on the tiny config: run directory, parity with one process, bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLES, TINY, Result, meshrun, metrics_records, train_tiny

# Each layout trains the tiny config once; the run-directory checks read the ddp2 run, and the
# parity check compares them all (a launch costs far more than the 20 steps it runs).
LAYOUT_RUNS = {
    "ddp2": ["--nproc-per-node", "2", "--set", "train.batch_size=4", "--set", "metrics.charts=png"],
    "single": ["--nproc-per-node", "1", "--set", "train.batch_size=8"],
    "accum": ["--nproc-per-node", "1", "--set", "train.batch_size=4", "--set", "train.grad_accum=2"],
    "fsdp2": ["--nproc-per-node", "2", "--set", "train.batch_size=4", "--set", "parallel.strategy=fsdp"],
    "tp2": ["--nproc-per-node", "2", "--set", "train.batch_size=8", "--set", "parallel.strategy=fsdp",
            "--set", "parallel.dp_replicate=1", "--set", "parallel.tp=2"],
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory) -> dict[str, tuple[Result, Path]]:
    tmp = tmp_path_factory.mktemp("layouts")
    runs = {}
    for name, args in LAYOUT_RUNS.items():  # eval_interval=0: eval at step 0 and at the end only
        # "single" as a user starts it: OMP_NUM_THREADS unset, so the worker is exec'd, not preloaded,
        # with torch's default threads. OMP_WAIT_POLICY=PASSIVE: the same threads and the same sums,
        # but an idle OpenMP thread sleeps instead of spinning against the other test worker
        # (this run under load: 11.2 CPU-s spinning, 6.5 passive).
        env = {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": "PASSIVE"} if name == "single" else None
        result, run_dir = train_tiny(tmp, name, *args, "--set", "metrics.interval=1", "--set", "train.eval_interval=0",
                                     env=env)
        assert result.returncode == 0, f"{name}: {result.output}"
        runs[name] = (result, run_dir)
    return runs


def test_tiny_run_writes_config_metrics_weights_and_curves(layout_runs):
    result, run_dir = layout_runs["ddp2"]
    for name in ("config.toml", "metrics.jsonl", "model.pt", "report.html", "loss.png"):
        assert (run_dir / name).is_file(), name
    evals = [r["eval_loss"] for r in metrics_records(run_dir, "eval")]
    assert [r["step"] for r in metrics_records(run_dir, "eval")] == [0, 20]
    assert evals[-1] < evals[0] - 0.5, evals  # it learns
    train_rows = metrics_records(run_dir, "train")
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_bytes"} <= set(train_rows[-1])
    assert "[rank 1]" not in result.stdout  # progress is rank 0's job

    from meshrun.config import load_config
    from meshrun.models.factory import build_model

    cfg = load_config(run_dir / "config.toml")
    model = build_model(cfg.model, 259)
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))  # the unwrapped model


def test_layouts_match_one_process_and_accumulation_matches_a_bigger_batch(layout_runs):
    losses = {name: [r["loss"] for r in metrics_records(run_dir, "train")]
              for name, (_, run_dir) in layout_runs.items()}
    assert len(losses["single"]) == 20
    from meshrun.config import load_config
    from meshrun.models.factory import build_model

    fsdp_dir = layout_runs["fsdp2"][1]
    cfg = load_config(fsdp_dir / "config.toml")
    build_model(cfg.model, 259).load_state_dict(torch.load(fsdp_dir / "model.pt", weights_only=True))
    for name in ("ddp2", "accum", "fsdp2", "tp2"):
        diffs = [abs(a - b) for a, b in zip(losses[name], losses["single"], strict=True)]
        assert max(diffs) < 1e-5, (name, diffs)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "optim.lrr=1"], "did you mean 'optim.lr'"),
        (["--set", "optim.lr=-0.001"], "optim.lr must be > 0"),
        (["--nproc-per-node", "0"], "--nproc-per-node 0"),
        (["--set", "data.path=/nonexistent/tokens"], "/nonexistent/tokens"),
        (["--set", "model.factory=no_such_pkg.models:build"], "no_such_pkg"),
        (["--nproc-per-node", "2", "--set", "parallel.strategy=fsdp", "--set", "parallel.dp_replicate=1",
          "--set", "parallel.tp=3"], "parallel.tp=3"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, expected):
    result = meshrun("train", TINY, "--set", f"train.run_dir={tmp_path}", *args, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.output


def test_corrupt_token_file_is_one_line_exit_2(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello distributed world. " * 400)
    prepared = meshrun("data", "prepare", str(text), "--out", str(tmp_path / "tok"), timeout=120)
    assert prepared.returncode == 0, prepared.output
    bin_file = next((tmp_path / "tok").glob("*.bin"))
    bin_file.write_bytes(bin_file.read_bytes()[:-10])  # truncated
    result = meshrun("train", TINY, "--set", f"train.run_dir={tmp_path}", "--set", f"data.path={tmp_path / 'tok'}",
                     timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "tok" in lines[0], result.stderr


def test_config_show_lists_every_key_with_default_and_doc():
    result = meshrun("config", "show", TINY, "--set", "optim.lr=0.01", timeout=60)
    assert result.returncode == 0, result.output
    assert re.search(r"^lr\s*=\s*0\.01\b", result.stdout, re.M), result.stdout
    for section in ("model", "data", "train", "optim", "parallel", "checkpoint", "metrics", "launch"):
        assert f"[{section}]" in result.stdout


def test_api_example_runs_under_launch(tmp_path):
    result = meshrun("launch", "--nproc-per-node", "2", str(EXAMPLES / "api_custom_loop.py"), cwd=tmp_path,
                     timeout=180)
    assert result.returncode == 0, result.output
    assert result.stdout.count("[rank 0] epoch") == 3 and "8 batches per rank" in result.stdout


USER_MODEL = """\
from torch import nn


class Bigram(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 32)
        self.out = nn.Linear(32, vocab_size)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


def build(model_cfg, vocab_size):
    return Bigram(vocab_size)
"""


def test_user_model_factory_trains(tmp_path):
    (tmp_path / "mymodels.py").write_text(USER_MODEL)
    result, run_dir = train_tiny(tmp_path, "factory", "--nproc-per-node", "2", "--set", "model.factory=mymodels:build",
                             "--set", "train.steps=10", "--set", "train.eval_interval=0")
    assert result.returncode == 0, result.output
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert set(state) == {"emb.weight", "out.weight", "out.bias"}


def test_bf16_autocast_with_activation_checkpointing_trains(tmp_path):
    result, run_dir = train_tiny(tmp_path, "bf16", "--nproc-per-node", "2", "--set", "train.dtype=bf16",
                             "--set", "train.activation_checkpointing=true", "--set", "train.steps=10")
    assert result.returncode == 0, result.output
    losses = [r["loss"] for r in metrics_records(run_dir, "train")]
    assert losses and all(0 < x < 10 for x in losses)
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert "layers.0.attention.wq.weight" in state  # checkpoint wrappers leave the names alone
