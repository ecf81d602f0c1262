"""`meshrun data prepare` throughput: --workers N against --workers 1, on the same input in the same run.

    python benchmarks/data_prepare.py --mb 20 --workers 1 2 4
    python benchmarks/data_prepare.py --mb 50 --tokenizer byte --format parquet

Writes a synthetic .jsonl (or .parquet) of about --mb MB of prose-like records and, unless
--tokenizer byte, a byte-level BPE (vocab 4096) trained here on a sample of it; then runs
prepare_tokens once per worker count (--repeats times, best kept, alternating the counts so that
machine noise hits all alike), checks that every run wrote the same bytes, and prints MB/s,
tokens/s and the ratio to --workers 1. Nothing is downloaded. Bounded by --timeout.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the quick brown fox jumps over lazy dog while seven small models train on sharded data "
         "across many ranks and every token is seen exactly once per epoch in this corpus").split()


def make_inputs(root: Path, mb: float, fmt: str, seed: int = 0) -> tuple[Path, list[str]]:
    rng = random.Random(seed)
    docs, size = [], 0
    while size < mb * 1e6:
        doc = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400))) + "."
        docs.append(doc)
        size += len(doc) + 12
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = root / "bench.parquet"
        pq.write_table(pa.table({"text": docs}), path, row_group_size=2000)
    else:
        path = root / "bench.jsonl"
        with path.open("w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
    return path, docs[:2000]


def make_tokenizer(root: Path, sample: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=4096, special_tokens=["<unk>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return root / "tok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=20.0, help="input size in MB (default 20)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts; 1 is the baseline")
    parser.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--repeats", type=int, default=2, help="runs per worker count; the best is kept")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before the whole benchmark stops")
    args = parser.parse_args()
    signal.alarm(int(args.timeout))  # bounded: SIGALRM ends the process
    from meshrun.data.prepare import prepare_tokens
    from meshrun.data.tokenizer import load_tokenizer

    counts = sorted(set([1, *args.workers]))
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-prepare-") as tmp:
        root = Path(tmp)
        path, sample = make_inputs(root, args.mb, args.format)
        tok = load_tokenizer("byte" if args.tokenizer == "byte" else make_tokenizer(root, sample))
        size = path.stat().st_size
        best: dict[int, float] = {}
        digests, tokens = set(), 0
        for r in range(args.repeats):
            for n in counts if r % 2 == 0 else reversed(counts):
                start = time.perf_counter()
                meta = prepare_tokens([path], root / f"out{n}", tok, workers=n)
                best[n] = min(best.get(n, float("inf")), time.perf_counter() - start)
                digests.add(meta.sha256)
                tokens = meta.num_tokens
        print(f"input {args.format} {size / 1e6:.1f} MB, tokenizer {args.tokenizer} (vocab {tok.vocab_size}), "
              f"{tokens:,} tokens; best of {args.repeats}")
        for n in counts:
            print(f"  workers {n:>2}: {best[n]:6.2f} s  {size / 1e6 / best[n]:7.1f} MB/s  "
                  f"{tokens / best[n] / 1e6:6.2f} M tok/s  x{best[1] / best[n]:.2f} vs workers 1")
        print("identical output for every worker count:", "yes" if len(digests) == 1 else "NO")
        return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
