"""Data for meshrun: tokenizers, token files, a resumable distributed sampler and the train/val loaders.

    meshrun data prepare book.txt --out data/book          # text -> data/book/tokens.bin + meta.json
    meshrun data prepare train.jsonl --out data/t --tokenizer tok/   # a Hugging Face tokenizer directory

    from meshrun.data import ResumableDistributedSampler
    sampler = ResumableDistributedSampler(len(my_dataset), num_replicas=dp_size, rank=dp_rank, seed=0)
    loader = DataLoader(my_dataset, batch_size=8, sampler=sampler, drop_last=True)

See docs/data.md.
"""

from __future__ import annotations

from typing import Any

from meshrun.data.corpus import corpus_path, load_corpus_text
from meshrun.data.prepare import prepare_tokens
from meshrun.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from meshrun.data.tokens import TokenMeta, open_token_dir, open_tokens, read_meta

# torch-backed names load on first use: `meshrun data prepare` and the CLI front never import torch.
_LAZY = {
    "InfiniteLoader": "loader", "TokenWindowDataset": "loader", "build_loaders": "loader",
    "load_data_tokens": "loader", "split_tokens": "loader", "ResumableDistributedSampler": "sampler",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"meshrun.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'meshrun.data' has no attribute {name!r}")


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
