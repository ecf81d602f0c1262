"""`meshrun data prepare` end to end on .jsonl, .parquet and a `datasets` save_to_disk directory with a
Hugging Face tokenizer directory, then `meshrun train` on the result: it trains."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import meshrun, metrics_records, requires, save_hf_tokenizer, train_tiny

pytestmark = requires("pyarrow", "datasets", "tokenizers")

DOCS = [f"record {i}: a small fox {'runs ' * (i % 4)}past {i % 9} sleepy dogs and one cat." for i in range(150)]


def test_prepare_jsonl_parquet_and_save_to_disk_then_train(tmp_path: Path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in DOCS[:50]))
    pq.write_table(pa.table({"content": DOCS[50:100]}), tmp_path / "b.parquet", row_group_size=20)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": DOCS[100:]})}).save_to_disk(str(tmp_path / "c"))
    tok = save_hf_tokenizer(tmp_path / "tok", DOCS, config={"eos_token": "</s>", "bos_token": "<s>"})

    prep = meshrun("data", "prepare", "a.jsonl", "b.parquet", "c", "--out", "data", "--tokenizer", "tok",
                   "--text-field", "content", "--workers", "2", cwd=tmp_path, timeout=120)
    assert prep.returncode == 0, prep.output
    assert "from 3 input(s) to data/tokens.bin; vocab 320" in prep.stdout
    assert prep.stderr.startswith("tokenized 150 documents") and prep.stderr.count("\n") == 1, prep.stderr
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert [s["format"] for s in meta["sources"]] == ["jsonl", "parquet", "datasets"]
    assert [s["num_documents"] for s in meta["sources"]] == [50, 50, 50]

    result, run_dir = train_tiny(tmp_path, "hf_data", "--nproc-per-node", "1", "--set", "data.path=data",
                                 "--set", f"data.tokenizer={tok}", "--set", "train.steps=4",
                                 "--set", "train.eval_interval=0", "--set", "metrics.interval=1")
    assert result.returncode == 0, result.output
    losses = [r["loss"] for r in metrics_records(run_dir, "train")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(320), abs=0.5)  # a 320-token vocabulary, not the byte one's 259
