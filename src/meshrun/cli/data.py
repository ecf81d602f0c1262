"""`meshrun data prepare INPUT... --out DIR [--tokenizer byte|DIR|tokenizer.json] [--text-field F]
[--split S] [--workers N] [--val-fraction F] [--format text|chat|prompt-completion] [--train-on W] [--max-len N]`.

This module parses arguments and prints; the work is in `meshrun.data.prepare`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshrun.argparser import Parser
from meshrun.cli.argtypes import positive_int
from meshrun.errors import MeshrunError

DESCRIPTION = """\
Tokenize text into a token directory that `meshrun train` reads with data.path=DIR:
  DIR/tokens.bin   the token ids, memory-mapped at train time (uint16, or uint32 for vocabs > 65536),
                   with the tokenizer's end-of-text token after each document
  DIR/meta.json    dtype, token count, vocab size, tokenizer, sha256 and the source files

Inputs, by suffix (read as a stream, never whole):
  .txt (or any other)        UTF-8 text; each file is one document
  .jsonl .json .ndjson       one JSON object per line; --text-field names the text
  .parquet                   a Parquet file (pyarrow); --text-field names the text column
  DIR                        a `datasets` save_to_disk directory (Dataset, or DatasetDict: --split)

--format chat / prompt-completion read records ({"messages": [{"role", "content"}, ...]} or
{"prompt", "completion"}) and also write
  DIR/loss_mask.bin  one byte per token: 1 = trained as a target (assistant turns / the completion),
                     0 = left out of the loss (meshrun train gives those targets -100)
  DIR/examples.bin   the token offset where each example starts (int64)
Chats are rendered by the --tokenizer directory's own chat template (transformers, no remote code).
Records longer than --max-len, empty, with an unknown role or no assistant turn are skipped and
counted in the summary and meta.json, never truncated.
"""

EPILOG = """\
examples:
  meshrun data prepare book.txt --out data/book                         # built-in byte tokenizer
  meshrun data prepare texts/*.txt --out data/t --tokenizer tok/tokenizer.json --val-fraction 0.02
  meshrun data prepare train.jsonl more.parquet --out data/hf --tokenizer tok/ --text-field content
  meshrun data prepare my_dataset/ --split validation --out data/val --tokenizer tok/ --workers 4
  meshrun data prepare chats.jsonl --format chat --tokenizer tok/ --out data/chat --max-len 2048
  meshrun train --set data.path=data/book

Progress (documents, tokens per second, ETA) goes to stderr: redrawn in a terminal, else one final line.
exit status: 0 on success, 2 on bad input (missing file or field, not UTF-8, bad option, missing extra).
"""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value:g}")
    return value


def build_parser(prog: str = "meshrun data") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description="Prepare training data.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="{prepare}")
    prep = sub.add_parser("prepare", prog=f"{prog} prepare", description=DESCRIPTION, epilog=EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          help="tokenize text, .jsonl, .parquet or datasets directories into DIR/tokens.bin")
    prep.add_argument("inputs", nargs="+", metavar="INPUT",
                      help="text, .jsonl/.json, .parquet files or save_to_disk directories, in this order")
    prep.add_argument("--out", required=True, metavar="DIR",
                      help="output directory (created; a token directory prepared before is replaced; "
                           "never inside a checkpoint or an input)")
    prep.add_argument("--tokenizer", default="byte", metavar="SPEC",
                      help='"byte" (default: UTF-8 bytes + <eos>, vocab 259), a local Hugging Face tokenizer '
                           "directory (tokenizer.json + tokenizer_config.json: its eos ends each document) "
                           "or a tokenizer.json; read with the `tokenizers` package, never downloaded")
    prep.add_argument("--text-field", default="text", metavar="NAME",
                      help="the field holding the text in .jsonl/.parquet/datasets records (default: text)")
    prep.add_argument("--split", default=None, metavar="NAME",
                      help="the split of a DatasetDict directory (default: train)")
    prep.add_argument("--workers", type=positive_int, default=None, metavar="N",
                      help="processes that tokenize (default: the cores available; the byte tokenizer "
                           "always uses 1); the output is the same for any N")
    prep.add_argument("--val-fraction", type=_fraction, default=None, metavar="F",
                      help="hold out the last F of the tokens for eval, in [0, 1); recorded in meta.json "
                           "and used instead of data.val_fraction (default: not recorded, so "
                           "data.val_fraction decides)")
    prep.add_argument("--format", dest="records", choices=("text", "chat", "prompt-completion"), default="text",
                      help="text (default): the --text-field of each record (or a whole text file), every token "
                           "trained; chat: 'messages' rendered by the tokenizer's chat template; "
                           "prompt-completion: 'prompt' then 'completion' (chat and prompt-completion run in "
                           "one process: --workers does not apply)")
    prep.add_argument("--train-on", choices=("assistant", "prompt"), default="assistant",
                      help="with --format chat / prompt-completion: assistant (default) trains only the assistant "
                           "turns / the completion; prompt trains every token")
    prep.add_argument("--max-len", type=positive_int, default=None, metavar="N",
                      help="with --format chat / prompt-completion: skip (and count) records longer than N tokens "
                           "(default: no limit)")
    prep.add_argument("--force", action="store_true",
                      help="replace a tokens.bin or meta.json in DIR that data prepare did not write")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _prepare(args)
    except MeshrunError as exc:  # one line, exit 2, also when called without the dispatcher
        print(f"meshrun data: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _prepare(args: argparse.Namespace) -> int:
    from meshrun.config import set_flag
    from meshrun.data.encode import available_cores, effective_workers
    from meshrun.data.prepare import prepare_tokens
    from meshrun.data.prepare_progress import PrepareProgress
    from meshrun.data.tokenizer import load_tokenizer
    from meshrun.data.tokens import TOKENS_FILE

    _check_out(args)
    tokenizer = load_tokenizer(args.tokenizer)
    if args.records != "text":
        return _prepare_examples(args, tokenizer)
    workers = effective_workers(tokenizer, args.workers or available_cores())
    meta = prepare_tokens(args.inputs, args.out, tokenizer, val_fraction=args.val_fraction,
                          text_field=args.text_field, split=args.split, workers=workers,
                          progress=PrepareProgress(workers=workers))
    size_mb = meta.num_bytes / 1e6
    split = "" if meta.val_fraction is None else f", last {meta.val_fraction:g} held out for eval"
    print(f"wrote {meta.num_tokens:,} tokens ({meta.dtype}, {size_mb:.1f} MB) from {len(meta.sources)} "
          f"input(s) to {args.out}/{TOKENS_FILE}; vocab {meta.vocab_size} ({tokenizer.spec}){split}")
    print(f"train on it with: meshrun train {set_flag('data.path', args.out)}"
          + ("" if tokenizer.spec == "byte" else f" {set_flag('data.tokenizer', tokenizer.spec)}"))
    return 0


def _prepare_examples(args: argparse.Namespace, tokenizer) -> int:
    from meshrun.config import set_flag
    from meshrun.data.prepare_chat import prepare_examples, summarize_skipped
    from meshrun.data.tokens import TOKENS_FILE

    meta = prepare_examples(args.inputs, args.out, tokenizer, records_kind=args.records, train_on=args.train_on,
                            max_len=args.max_len, val_fraction=args.val_fraction, split=args.split)
    trained = meta.loss_mask["num_trained"]
    skipped = summarize_skipped(meta.skipped or {}, args.max_len)
    print(f"wrote {meta.num_tokens:,} tokens ({trained:,} trained, {trained / meta.num_tokens:.0%}) in "
          f"{meta.examples['count']:,} {args.records} examples from {len(meta.sources)} input(s) to "
          f"{args.out}/{TOKENS_FILE}; vocab {meta.vocab_size} ({tokenizer.spec})")
    print(f"skipped: {skipped}" if skipped else "skipped: none")
    print(f"train on it with: meshrun train {set_flag('data.path', args.out)} "
          f"{set_flag('data.tokenizer', tokenizer.spec)}")
    return 0


def _check_out(args: argparse.Namespace) -> None:
    """--out is never an input or inside one, never in a checkpoint; its files only replaced if ours."""
    from meshrun.checkpoint.outputs import check_output
    from meshrun.data.tokenizer import BYTE_SPEC
    from meshrun.data.tokens import EXAMPLES_FILE, LOSS_MASK_FILE, META_FILE, TOKENS_FILE, read_meta

    out = Path(args.out).expanduser()

    def prepared_here(_path: Path) -> bool:  # an earlier prepare's directory: its meta.json reads
        try:
            read_meta(out)
        except MeshrunError:
            return False
        return True

    inputs = [*args.inputs, *([] if args.tokenizer.strip() in ("", BYTE_SPEC) else [args.tokenizer])]
    check_output("--out", out, inputs=inputs, writes=[out / n for n in (TOKENS_FILE, META_FILE, LOSS_MASK_FILE, EXAMPLES_FILE)], force=args.force,
                 ours=prepared_here)
