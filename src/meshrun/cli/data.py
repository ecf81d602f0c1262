"""`meshrun data prepare TEXT... --out DIR [--tokenizer byte|tokenizer.json] [--val-fraction F]`.

This module parses arguments and prints; the work is in `meshrun.data.tokens`.
"""

from __future__ import annotations

import argparse
import sys

from meshrun.errors import MeshrunError

DESCRIPTION = """\
Tokenize UTF-8 text files into a token directory that `meshrun train` reads with data.path=DIR:
  DIR/tokens.bin   the token ids, memory-mapped at train time (uint16, or uint32 for vocabs > 65536),
                   with the tokenizer's end-of-text token after each file
  DIR/meta.json    dtype, token count, vocab size, tokenizer, sha256 and the source files
"""

EPILOG = """\
examples:
  meshrun data prepare book.txt --out data/book                         # built-in byte tokenizer
  meshrun data prepare texts/*.txt --out data/t --tokenizer tok/tokenizer.json --val-fraction 0.02
  meshrun train --set data.path=data/book

exit status: 0 on success, 2 on bad input (missing file, not UTF-8, bad option).
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
    parser = argparse.ArgumentParser(prog=prog, description="Prepare training data.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="{prepare}")
    prep = sub.add_parser("prepare", prog=f"{prog} prepare", description=DESCRIPTION, epilog=EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          help="tokenize text files into DIR/tokens.bin + DIR/meta.json")
    prep.add_argument("text", nargs="+", metavar="TEXT", help="UTF-8 text files, concatenated in this order")
    prep.add_argument("--out", required=True, metavar="DIR",
                      help="output directory (created; an existing token directory is overwritten)")
    prep.add_argument("--tokenizer", default="byte", metavar="SPEC",
                      help='"byte" (default: UTF-8 bytes + <eos>, vocab 259) or the path of a local '
                           "tokenizer.json, read with the `tokenizers` package; never downloaded")
    prep.add_argument("--val-fraction", type=_fraction, default=None, metavar="F",
                      help="hold out the last F of the tokens for eval, in [0, 1); recorded in meta.json "
                           "and used instead of data.val_fraction (default: not recorded, so "
                           "data.val_fraction decides)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _prepare(args)
    except MeshrunError as exc:  # one line, exit 2, also when called without the dispatcher
        print(f"meshrun data: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _prepare(args: argparse.Namespace) -> int:
    from meshrun.data.tokenizer import load_tokenizer
    from meshrun.data.tokens import TOKENS_FILE, prepare_tokens

    tokenizer = load_tokenizer(args.tokenizer)
    meta = prepare_tokens(args.text, args.out, tokenizer, val_fraction=args.val_fraction)
    size_mb = meta.num_bytes / 1e6
    split = "" if meta.val_fraction is None else f", last {meta.val_fraction:g} held out for eval"
    print(f"wrote {meta.num_tokens:,} tokens ({meta.dtype}, {size_mb:.1f} MB) from {len(meta.sources)} "
          f"file(s) to {args.out}/{TOKENS_FILE}; vocab {meta.vocab_size} ({tokenizer.spec}){split}")
    print(f"train on it with: meshrun train --set data.path={args.out}"
          + ("" if tokenizer.spec == "byte" else f" --set data.tokenizer={tokenizer.spec}"))
    return 0
