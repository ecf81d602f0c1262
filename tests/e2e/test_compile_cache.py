"""train.compile's cache survives a restart: a resumed run loads its kernels from <run dir>/compile-cache.

One process, the tiniest model (dim 32, 4 blocks, seq 16), compile=true: 2 steps, then the same
run trained further (--force, train.steps=3), which resumes from its step-2 checkpoint and
compiles again. The first start's compile row in metrics.jsonl counts FX graph cache misses and
no hits; the second's only hits (inductor's and AOTAutograd's own counters, not a timing).
"""

from __future__ import annotations

import pytest
from conftest import metrics_records, train_tiny

from meshrun.parallel.compile import CACHE_DIR

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ARGS = ("--nproc-per-node", "1", "--set", "train.compile=true", "--set", "model.dim=32", "--set", "model.n_layers=4",
        "--set", "model.n_heads=4", "--set", "model.n_kv_heads=4", "--set", "data.seq_len=16",
        "--set", "train.batch_size=4", "--set", "train.eval_interval=0", "--set", "train.eval_steps=1",
        "--set", "checkpoint.interval=1")


def test_a_resumed_run_reuses_the_compile_cache(tmp_path):
    first, run_dir = train_tiny(tmp_path, "c", *ARGS, "--set", "train.steps=2", timeout=500)
    assert first.returncode == 0, first.output[-3000:]
    assert "compiling the model (torch.compile" in first.stdout
    assert any((run_dir / CACHE_DIR).rglob("*")), "the cache directory is empty"
    again, _ = train_tiny(tmp_path, "c", *ARGS, "--set", "train.steps=3", "--force", timeout=500)
    assert again.returncode == 0, again.output[-3000:]
    assert "resumed from" in again.output
    cold, warm = [r for r in metrics_records(run_dir, "meta") if r.get("event") == "compile"]
    assert cold["fx_graph_cache_miss"] > 0 and cold["fx_graph_cache_hit"] == 0, cold
    assert warm["fx_graph_cache_hit"] > 0 and warm["fx_graph_cache_miss"] == 0, warm
    assert warm["autograd_cache_hit"] > 0 and warm["graph_breaks"] == 0, warm
    print(f"compile: {cold['compile_s']} s cold, {warm['compile_s']} s after the restart")
