"""`meshrun generate RUN_OR_CKPT_OR_HF_DIR --prompt TEXT`: sample text from a trained model, in one process.

    meshrun generate runs/tiny --prompt "The "                        # model.pt, else the latest checkpoint
    meshrun generate runs/tiny/checkpoints/step-00000020 --prompt "The " --temperature 0   # greedy
    meshrun generate hf/tiny --prompt "The " --top-k 50 --top-p 0.9 --seed 7   # an HF directory
    meshrun generate hf/base --adapter adapter --chat --prompt "Hello"   # a peft adapter, the chat template

Prints the prompt and its continuation to stdout. The same seed gives the same text. A checkpoint
of any layout (FSDP, TP, PP, ...) is read without a process group. Needs transformers:
pip install 'meshrun[hf]'.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshrun.argparser import OneLineParser
from meshrun.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="meshrun generate", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("path", metavar="RUN_OR_CKPT_OR_HF_DIR",
                        help="a run directory, a checkpoint directory, or a Hugging Face model directory")
    parser.add_argument("--prompt", default="", help="text to continue ('' = start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to sample at most")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T",
                        help="softmax temperature; 0 = greedy (always the likeliest token)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest; 0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample among the likeliest tokens holding P of the probability; 1 = off")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text")
    parser.add_argument("--chat", action="store_true",
                        help="the prompt is a user's message, rendered by the tokenizer's chat template")
    parser.add_argument("--adapter", metavar="DIR", default=None,
                        help="a peft adapter directory (ckpt export --format peft) to merge into an HF model directory")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:  # bytes that are not UTF-8 reach Python's argv as lone surrogates
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"--prompt is not UTF-8 text (character {exc.start}); "
                          "give the prompt in UTF-8 (check the terminal's or the script's encoding)") from None
    from meshrun.trained.generate import Sampler, generate_text, load

    sampler = Sampler(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    loaded = load(Path(args.path), Path(args.adapter) if args.adapter else None)
    text = generate_text(loaded, args.prompt, sampler, chat=args.chat)
    sys.stdout.write(text + ("" if text.endswith("\n") else "\n"))
    return 0
