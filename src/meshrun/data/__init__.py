"""Data for meshrun: tokenizers, token files, a resumable distributed sampler and the train/val loaders.

    meshrun data prepare book.txt --out data/book          # text -> data/book/tokens.bin + meta.json
    meshrun data prepare train.jsonl --out data/t --tokenizer tok/   # a Hugging Face tokenizer directory

    from meshrun.data import ResumableDistributedSampler
    sampler = ResumableDistributedSampler(len(my_dataset), num_replicas=dp_size, rank=dp_rank, seed=0)
    loader = DataLoader(my_dataset, batch_size=8, sampler=sampler, drop_last=True)

See docs/data.md.
"""

from __future__ import annotations

from meshrun.data.corpus import corpus_path, load_corpus_text
from meshrun.data.loader import (
    InfiniteLoader,
    TokenWindowDataset,
    build_loaders,
    load_data_tokens,
    split_tokens,
)
from meshrun.data.prepare import prepare_tokens
from meshrun.data.sampler import ResumableDistributedSampler
from meshrun.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from meshrun.data.tokens import TokenMeta, open_token_dir, open_tokens, read_meta

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "InfiniteLoader",
    "ResumableDistributedSampler",
    "TokenMeta",
    "TokenWindowDataset",
    "Tokenizer",
    "build_loaders",
    "corpus_path",
    "load_corpus_text",
    "load_data_tokens",
    "load_tokenizer",
    "open_token_dir",
    "open_tokens",
    "prepare_tokens",
    "read_meta",
    "split_tokens",
]
