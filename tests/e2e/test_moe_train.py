"""`meshrun train examples/configs/tiny-moe.toml` end to end on 2 FSDP ranks: the run names its
expert compute, metrics.jsonl's train records carry the moe_* figures, the report charts the
expert load, and the expert bias the trainer moved after each step is saved with the weights. Parity with one process is
tests/distributed/test_moe_parity.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import EXAMPLES, meshrun, metrics_records

pytestmark = pytest.mark.timeout(90)


def test_tiny_moe_example_trains_and_logs_the_expert_load(tmp_path):
    result = meshrun("train", str(EXAMPLES / "configs" / "tiny-moe.toml"), "--set", "train.name=moe",
                     "--set", f"train.run_dir={tmp_path}", "--set", "parallel.strategy=fsdp",
                     "--set", "train.steps=6", "--set", "metrics.interval=3", "--set", "train.eval_interval=0",
                     timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert ("mixture of experts: 4 experts (top 2, 1 shared) in 2 of 2 blocks, balance 'bias'; "
            "the experts compute as a loop over the experts (cpu, float32)") in result.output
    train = metrics_records(tmp_path / "moe", "train")
    assert [r["step"] for r in train] == [3, 6]
    for record in train:
        assert 1.0 <= record["moe_load_max_over_mean"] <= 2.0  # at most experts / top-k
        assert record["moe_tokens_dropped"] == 0
        assert 0 < record["moe_router_entropy"] <= math.log(4)
        assert "moe_aux_loss" not in record  # balanced by the bias
    assert (tmp_path / "moe" / "expert_load.svg").is_file()  # the report charts the load balance
    state = torch.load(tmp_path / "moe" / "model.pt", weights_only=True)
    assert state["layers.0.feed_forward.expert_bias"].abs().sum() > 0  # moved, and saved
