"""Trained tokens per second with data.packing against padding, on a length-skewed chat set.

    python benchmarks/packing.py                      # about 2 minutes on 2 CPU cores
    python benchmarks/packing.py --seconds 30 --seq-len 2048 --dim 512 --device cuda

Builds everything here (nothing is downloaded): a byte-level BPE (vocab 512) with a chat template,
--records conversations of which 90% are short (a question and an answer of a few to 40 words)
and 10% long (an answer of seq_len/3 to 2 seq_len/3 words: up to about 90% of a row), and their
chat token directory (`meshrun data prepare --format chat`'s code). Then trains the built-in model for --seconds per mode, in one process,
through meshrun's own step (`layout_step`, the loss averaged over trained tokens), on the same
shuffled example order, and counts the trained targets (assistant tokens) per second:

- packed: `data.packing = true` (meshrun.data.packing): examples packed into rows of --seq-len,
  attention kept inside each example by a block-causal mask;
- padded: one example per row, padded to --seq-len (fixed shapes);
- padded-dynamic: one example per row, padded to the longest row of the batch (what a padding
  collator does).

Modes alternate, --repeats times each (the best of each kept), so that machine noise hits all alike.
Prints one row per mode and the ratios of packed to each. Bounded by --timeout.
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

WORDS = ("the model reads a question and writes a short answer about data parallel training on many "
         "ranks where each token is seen once and every step averages the loss over trained tokens").split()
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def make_tokenizer(root: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20 + ["user assistant"], trainer)
    out = root / "tok"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE}))
    return out


def make_chats(root: Path, records: int, seed: int, seq_len: int) -> Path:
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    lines = []
    for _ in range(records):
        long = rng.random() < 0.1
        answer = words(seq_len // 3, seq_len * 2 // 3) if long else words(3, 40)  # ~1.3 tokens a word
        lines.append(json.dumps({"messages": [{"role": "user", "content": words(4, 20) + "?"},
                                              {"role": "assistant", "content": answer}]}))
    path = root / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def batches(ds, batch_size: int, seed: int, *, packed: bool, dynamic: bool):
    """The dataset's rows in one shuffled order, batched; padded rows without positions (one
    example a row: plain causal attention), trimmed to the batch's longest with `dynamic`."""
    import torch

    from meshrun.data.sampler import ResumableDistributedSampler

    order = list(ResumableDistributedSampler(len(ds), 1, 0, seed))
    while True:
        for i in range(0, len(order) - batch_size + 1, batch_size):
            rows = [ds[j] for j in order[i : i + batch_size]]
            inputs, targets, positions = (torch.stack(col) for col in zip(*rows, strict=True))
            if packed:
                yield inputs, targets, positions
                continue
            width = inputs.shape[1]
            if dynamic:  # the first example of each row is all there is: its positions rise from 0
                width = int((positions == torch.arange(width)).sum(1).max())
            yield inputs[:, :width], targets[:, :width]


def run_mode(ds, args, *, packed: bool, dynamic: bool = False) -> dict:
    import torch

    from meshrun.data.tokens import IGNORE_INDEX
    from meshrun.models.llama import ModelArgs, Transformer
    from meshrun.parallel.layout import BuiltLayout
    from meshrun.train.step import layout_step

    device = torch.device(args.device)
    model = Transformer(ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=4, vocab_size=512,
                                  max_seq_len=args.seq_len), seed=0).to(device)
    layout = BuiltLayout([model], dp_rank=0, dp_size=1, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen: list = []

    def recorded():
        for batch in batches(ds, args.batch_size, args.seed, packed=packed, dynamic=dynamic):
            seen.append(batch)
            yield batch

    source = recorded()
    dtype = "bf16" if device.type == "cuda" else "fp32"
    step = dict(grad_accum=1, dtype=dtype, grad_clip=1.0, masked=True)
    layout_step(layout, [opt], source, **step)  # warm-up, not counted
    seen.clear()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < args.seconds:
        layout_step(layout, [opt], source, **step)
        steps += 1
    sync()
    elapsed = time.perf_counter() - started
    trained = sum(int((b[1] != IGNORE_INDEX).sum()) for b in seen)
    columns = sum(b[0].numel() for b in seen)
    return {"steps": steps, "s": elapsed, "trained_per_s": trained / elapsed, "fill": trained / max(columns, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=2000, help="conversations in the set")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (data.seq_len)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step")
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=2, help="model blocks")
    p.add_argument("--seconds", type=float, default=10.0, help="training time per mode and repeat")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating; the best is kept")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the benchmark gives up (exit 3)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGALRM, lambda *_: (print(f"timed out after {args.timeout:.0f} s"), sys.exit(3)))
    signal.alarm(int(args.timeout))
    import torch

    from meshrun.data.packing import PackedExampleDataset
    from meshrun.data.prepare_chat import prepare_examples
    from meshrun.data.tokenizer import load_tokenizer
    from meshrun.data.tokens import open_examples, open_loss_mask, open_token_dir

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok = make_tokenizer(root)
        meta = prepare_examples([make_chats(root, args.records, args.seed, args.seq_len)], root / "chat", load_tokenizer(tok),
                                records_kind="chat", tokenizer_dir=tok, max_len=args.seq_len + 1)
        tokens, meta = open_token_dir(root / "chat")
        mask, bounds = open_loss_mask(root / "chat", meta), open_examples(root / "chat", meta)
        lengths = (bounds[1:] - bounds[:-1]).float()
        print(f"{meta.examples['count']} chat examples ({meta.skipped or 'none'} skipped), tokens per example: "
              f"median {lengths.median():.0f}, mean {lengths.mean():.0f}, max {lengths.max():.0f}; "
              f"seq_len {args.seq_len}, batch {args.batch_size}, dim {args.dim} x {args.layers} layers, "
              f"{args.device} ({args.threads} thread(s)), {args.seconds:g} s per run, best of {args.repeats}")
        packed = PackedExampleDataset(tokens, mask, bounds, args.seq_len)
        alone = PackedExampleDataset(tokens, mask, bounds, args.seq_len, one_per_sequence=True)
        modes = {"packed": (packed, dict(packed=True)), "padded": (alone, dict(packed=False)),
                 "padded-dynamic": (alone, dict(packed=False, dynamic=True))}
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, (ds, kw) in modes.items():
                got = run_mode(ds, args, **kw)
                if name not in best or got["trained_per_s"] > best[name]["trained_per_s"]:
                    best[name] = got
    print(f"{'mode':<15} {'rows':>6} {'steps':>6} {'trained tok/s':>14} {'trained/column':>15}")
    for name, (ds, _) in modes.items():
        r = best[name]
        print(f"{name:<15} {len(ds):>6} {r['steps']:>6} {r['trained_per_s']:>14,.0f} {r['fill']:>15.1%}")
    for name in ("padded", "padded-dynamic"):
        print(f"packed / {name}: {best['packed']['trained_per_s'] / best[name]['trained_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
