"""Stragglers named live by `meshrun train` (metrics/stragglers.py), 2 gloo processes: a rank made
slow (a user model that sleeps 15 ms in each training forward on rank 1 only) is named in the
progress line and in metrics.jsonl within 100 steps, and the report says from which step; the same
run without the sleep names nobody."""

from __future__ import annotations

import json
import re

import pytest
from conftest import TINY, meshrun

pytestmark = pytest.mark.timeout(240)

MODEL = """\
import os, time
from torch import nn

class Bigram(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, vocab)

    def forward(self, tokens):
        if self.training and os.environ.get("RANK") == os.environ.get("SLOW_RANK"):
            time.sleep(0.015)
        return self.emb(tokens)

def build(model_cfg, vocab_size):
    return Bigram(vocab_size)
"""


def _run(tmp_path, name: str, slow_rank: str | None):
    (tmp_path / "slowmodel.py").write_text(MODEL)
    env = {"PYTHONPATH": str(tmp_path), "SLOW_RANK": slow_rank}
    result = meshrun("train", TINY, "--nproc-per-node", "2", "--set", f"train.name={name}",
                     "--set", f"train.run_dir={tmp_path}", "--set", "model.factory=slowmodel:build",
                     "--set", "train.steps=110", "--set", "train.eval_interval=0", "--set", "checkpoint.interval=0",
                     "--set", "train.log_interval=50", env=env, cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.output[-4000:]
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result.output, [r for r in rows if r.get("event") in ("straggler", "straggler_cleared")]


def test_a_slow_rank_is_named_live_and_a_balanced_run_names_nobody(tmp_path):
    out, rows = _run(tmp_path, "slow", "1")
    assert rows and rows[0]["event"] == "straggler" and rows[0]["rank"] == 1 and rows[0]["step"] <= 100, rows
    assert re.search(r"straggler: rank 1 is \d+(\.\d)?x slower than the median of the others", out), out[-3000:]
    assert not [r for r in rows if r["rank"] == 0], rows
    report = meshrun("report", str(tmp_path / "slow"), timeout=60)
    assert report.returncode == 0, report.output
    html = (tmp_path / "slow" / "report.html").read_text()
    assert f"rank 1 from step {rows[0]['step']}:" in html, html[-3000:]

    out, rows = _run(tmp_path, "balanced", None)
    assert rows == [] and "straggler" not in out, out[-3000:]
