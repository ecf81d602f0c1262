"""Train and val loaders for `meshrun train`: token source -> windows -> split -> sampler -> DataLoader.

    train, val, tokenizer = build_loaders(cfg.data, seq_len=256, batch_size=8,
                                          dp_rank=rank, dp_size=world, seed=cfg.train.seed)
    for step, (x, y) in zip(range(steps), train):   # forever; epochs advance by themselves
        ...
    state = train.state_dict()                       # exact position, for the checkpoint

data.path picks the source: "" is the built-in corpus, a file is text tokenized now, and a
directory is a token directory from `meshrun data prepare`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from meshrun.data.corpus import load_corpus_text
from meshrun.data.packing import packed_split
from meshrun.data.sampler import ResumableDistributedSampler
from meshrun.data.split import split_sizes
from meshrun.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_fingerprint
from meshrun.data.tokens import (
    IGNORE_INDEX,
    encode_file,
    encode_text,
    open_examples,
    open_loss_mask,
    open_token_dir,
    read_meta,
)
from meshrun.errors import DataError

log = logging.getLogger(__name__)


class TokenWindowDataset(Dataset):
    """Windows of a 1-D token array: item i is (tokens[s:s+L], tokens[s+1:s+L+1]) as int64, s = i*stride.

    stride defaults to seq_len: windows whose targets do not overlap, so an epoch sees each
    token once as a target. `tokens` may be a memory-mapped uint16/uint32 tensor: only the
    windows that are read are loaded. `loss_mask` (uint8, one per token, from a chat or
    prompt-completion token directory): a target whose mask is 0 becomes IGNORE_INDEX.
    """

    def __init__(self, tokens: torch.Tensor | Sequence[int], seq_len: int, stride: int | None = None,
                 loss_mask: torch.Tensor | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        stride = seq_len if stride is None else stride
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.tokens = tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(tokens)
        self.seq_len, self.stride = seq_len, stride
        if loss_mask is not None and len(loss_mask) != len(self.tokens):
            raise ValueError(f"loss_mask has {len(loss_mask)} entries for {len(self.tokens)} tokens")
        self.loss_mask = loss_mask

    @property
    def masked(self) -> bool:
        """Some targets are left out of the loss: the step averages over trained tokens."""
        return self.loss_mask is not None

    def __len__(self) -> int:
        n = len(self.tokens)
        return 0 if n < self.seq_len + 1 else (n - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = (index % len(self)) * self.stride
        chunk = self.tokens[start : start + self.seq_len + 1].to(torch.int64)
        if self.loss_mask is None:
            return chunk[:-1], chunk[1:]
        trained = self.loss_mask[start + 1 : start + self.seq_len + 1].bool()
        return chunk[:-1], chunk[1:].masked_fill(~trained, IGNORE_INDEX)


def effective_val_fraction(data_cfg: Any, prepared_val: float | None) -> float:
    """data.val_fraction, unless `meshrun data prepare` recorded one for the token directory."""
    val_fraction = float(data_cfg.val_fraction)
    if prepared_val is not None and prepared_val != val_fraction:
        log.info("data: using the val_fraction %s recorded by `meshrun data prepare`, not "
                 "data.val_fraction=%s", prepared_val, val_fraction)
    return val_fraction if prepared_val is None else prepared_val


def split_tokens(tokens: torch.Tensor, val_fraction: float, *,
                 seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Contiguous split: train = the head, val = the held-out tail of `val_fraction` of the tokens."""
    n_train, n_val = split_sizes(len(tokens), val_fraction, seq_len)
    train = tokens[:n_train]
    return train, (tokens[n_train:] if n_val else None)


def _batch_len(batch: Any) -> int:
    """Samples in a collated batch: the leading dim of its first tensor."""
    while isinstance(batch, (list, tuple, dict)):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(batch)


class InfiniteLoader:
    """Batches of a DataLoader forever, across epochs, with an exact position for checkpoints.

    `state_dict()` counts the batches delivered to the caller, not the indices the DataLoader
    has prefetched, and returns it in ResumableDistributedSampler's format (global count), so
    a run can resume on a different number of ranks.
    """

    def __init__(self, dataloader: DataLoader):
        self.dataloader = dataloader
        sampler = dataloader.sampler
        self.sampler = sampler if isinstance(sampler, ResumableDistributedSampler) else None
        self._it: Iterator | None = None
        self._start: tuple[int, int] = (0, 0)
        self._delivered = 0  # samples handed to the caller in the current pass, on this rank
        self._epoch = 0  # used only without a ResumableDistributedSampler

    @property
    def masked(self) -> bool:
        """The data has a loss mask (`TokenWindowDataset.masked`)."""
        return bool(getattr(self.dataloader.dataset, "masked", False))

    @property
    def epoch(self) -> int:
        """The epoch of the last batch delivered (of the next one, before any)."""
        if self.sampler is None:
            return self._epoch
        return self._start[0] if self._it is not None else self.sampler.epoch

    def __iter__(self) -> InfiniteLoader:
        return self

    def __next__(self) -> Any:
        for _ in range(2):  # at most one pass may end before a batch comes
            if self._it is None:
                self._begin_pass()
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self._epoch += 1
                continue
            self._delivered += _batch_len(batch)
            return batch
        raise DataError(f"the data loader yields no batch in a whole epoch ({self._describe()}); "
                        "use more data, a smaller batch_size or seq_len, or fewer ranks")

    def _begin_pass(self) -> None:
        if self.sampler is not None:
            # Where this pass starts: its batches are counted from here, not from the sampler,
            # which runs ahead when DataLoader workers prefetch.
            self._start = (self.sampler.epoch, self.sampler.consumed)
        elif hasattr(self.dataloader.sampler, "set_epoch"):
            self.dataloader.sampler.set_epoch(self._epoch)  # e.g. torch's DistributedSampler
        self._delivered = 0
        self._it = iter(self.dataloader)

    def _describe(self) -> str:
        dl = self.dataloader
        return f"{len(dl.dataset)} samples, batch_size {dl.batch_size}, sampler {dl.sampler!r}"

    def state_dict(self) -> dict:
        if self.sampler is None:
            raise TypeError("InfiniteLoader.state_dict needs a DataLoader whose sampler is a "
                            "ResumableDistributedSampler")
        state = self.sampler.state_dict()
        if self._it is not None:
            epoch, start = self._start
            consumed = start + self._delivered * self.sampler.num_replicas
            state.update(epoch=epoch, consumed=min(consumed, self.sampler.num_samples))
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.sampler is None:
            raise TypeError("InfiniteLoader.load_state_dict needs a ResumableDistributedSampler")
        self._it = None  # drops prefetched batches; the next batch comes from the loaded position
        self.sampler.load_state_dict(state)

    @property
    def batches_per_epoch(self) -> int:
        """Full batches per rank in a whole epoch."""
        n = len(self.dataloader.dataset)
        replicas = self.sampler.num_replicas if self.sampler is not None else 1
        return n // replicas // (self.dataloader.batch_size or 1)


# -- build_loaders ---------------------------------------------------------------------------------


def _check_tokenizer_matches(path: Path, meta_tok: dict, tokenizer: Tokenizer) -> None:
    ours = tokenizer_fingerprint(tokenizer)
    same = (ours["vocab_size"] == meta_tok.get("vocab_size")
            and (ours["spec"] == "byte") == (meta_tok.get("spec") == "byte")
            and ours["sha256"] == meta_tok.get("sha256")
            and meta_tok.get("eos_id", ours["eos_id"]) == ours["eos_id"])  # older meta: no eos_id
    if not same:
        def eos(fp: dict) -> str:  # shown when the meta records it
            return f", eos id {fp.get('eos_id')}" if "eos_id" in meta_tok else ""

        raise DataError(f"token directory {path} was prepared with tokenizer {meta_tok.get('spec')!r} "
                        f"(vocab {meta_tok.get('vocab_size')}{eos(meta_tok)}), but data.tokenizer is "
                        f"{ours['spec']!r} (vocab {ours['vocab_size']}{eos(ours)}); "
                        "set data.tokenizer to the one used by prepare")


def load_data_tokens(path: str, tokenizer: Tokenizer, *,
                     vocab_size: int | None = None) -> tuple[torch.Tensor, float | None]:
    """The token array for data.path, and the val_fraction that `prepare` recorded (or None)."""
    tokens, _, val_fraction = load_data(path, tokenizer, vocab_size=vocab_size)
    return tokens, val_fraction


def load_data(path: str, tokenizer: Tokenizer, *, vocab_size: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
    """(tokens, loss mask or None, recorded val_fraction or None) for data.path."""
    if not str(path).strip():  # the built-in corpus: encoded here, once per run (about 0.1 s in bytes)
        ids = encode_text(load_corpus_text(), tokenizer)
        if tokenizer.eos_id is not None:
            ids = torch.cat([ids, torch.tensor([tokenizer.eos_id])])
        return ids, None, None
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data.path={str(path)!r} does not exist; give a text file, a directory from "
                        "`meshrun data prepare FILE --out DIR`, or \"\" for the built-in corpus")
    if p.is_dir():
        tokens, meta = open_token_dir(p, vocab_size=vocab_size)
        _check_tokenizer_matches(p, meta.tokenizer, tokenizer)
        return tokens, open_loss_mask(p, meta), meta.val_fraction
    if not p.is_file():  # a device, FIFO or socket: /dev/zero would be read forever
        raise DataError(f"data.path={str(path)!r} is not a regular file; give a text file, a directory from "
                        "`meshrun data prepare FILE --out DIR`, or \"\" for the built-in corpus")
    ids = encode_file(p, tokenizer)
    if tokenizer.eos_id is not None:
        ids = torch.cat([ids, torch.tensor([tokenizer.eos_id])])
    if len(ids) == 0:
        raise DataError(f"data.path={str(path)!r} holds no text")
    return ids, None, None


def load_examples(path: str) -> torch.Tensor:
    """The example bounds of the token directory data.path (`open_examples`), for data.packing;
    one line when it has none (text, or not a token directory)."""
    p = Path(path).expanduser()
    bounds = open_examples(p, read_meta(p)) if str(path).strip() and p.is_dir() else None
    if bounds is None:
        raise DataError(f"data.packing=true packs the examples of a chat or prompt-completion token directory, "
                        f"but data.path={str(path)!r} has none; prepare one with `meshrun data prepare FILE "
                        "--format chat|prompt-completion`, or set data.packing=false")
    return bounds


def build_loaders(data_cfg: Any, *, seq_len: int | None = None, batch_size: int, dp_rank: int,
                  dp_size: int, seed: int, tokenizer: Tokenizer | None = None,
                  vocab_size: int | None = None) -> tuple[InfiniteLoader, DataLoader | None, Tokenizer]:
    """(train, val, tokenizer) for this data-parallel rank.

    data_cfg: any object with path, tokenizer, seq_len, val_fraction, shuffle, num_workers.
    seq_len: window length; None uses data_cfg.seq_len.
    batch_size: per-rank micro-batch size.
    dp_rank, dp_size: this rank's place among the data-parallel ranks (not the world, under TP/PP).
    seed: shuffle seed, the same on every rank.
    tokenizer: an already loaded tokenizer; None loads data_cfg.tokenizer.
    vocab_size: the model's vocab size; data needing a larger one is a DataError.

    train is an InfiniteLoader (batches (x, y) of shape [batch_size, seq_len], int64, forever);
    with a chat / prompt-completion token directory, targets left out of the loss are -100
    (IGNORE_INDEX) and `train.masked` is True. With data_cfg.packing (meshrun.data.packing)
    batches are (x, y, positions), the positions restarting at each packed example.
    val is a finite DataLoader over this rank's equal share of the held-out windows (in order,
    the same every time), or None when data.val_fraction is 0.
    """
    seq_len = int(seq_len if seq_len is not None else data_cfg.seq_len)
    if tokenizer is None:
        tokenizer = load_tokenizer(data_cfg.tokenizer)
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise DataError(f"data.tokenizer {tokenizer.spec!r} has vocab_size {tokenizer.vocab_size}, "
                        f"larger than the model's vocab_size {vocab_size}; raise the model's vocab_size")
    tokens, mask, prepared_val = load_data(data_cfg.path, tokenizer, vocab_size=vocab_size)
    val_fraction = effective_val_fraction(data_cfg, prepared_val)
    train_tokens, val_tokens = split_tokens(tokens, val_fraction, seq_len=seq_len)
    n_train = len(train_tokens)
    train_mask, val_mask = (None, None) if mask is None else (mask[:n_train], mask[n_train:])
    packing = bool(getattr(data_cfg, "packing", False))
    unit = "packed sequences" if packing else "windows"
    if packing:
        train_ds, val_ds = packed_split(tokens, mask, load_examples(data_cfg.path), seq_len, n_train=n_train)
    else:
        train_ds = TokenWindowDataset(train_tokens, seq_len, loss_mask=train_mask)
        val_ds = None if val_tokens is None else TokenWindowDataset(val_tokens, seq_len, loss_mask=val_mask)
    if len(train_ds) // dp_size < batch_size:
        raise DataError(f"the training data has {len(train_ds)} {unit} of seq_len {seq_len}: less than "
                        f"one batch per rank (batch_size {batch_size} x {dp_size} ranks); use more data "
                        "or a smaller seq_len or batch_size")
    sampler = ResumableDistributedSampler(len(train_ds), dp_size, dp_rank, seed,
                                          shuffle=bool(data_cfg.shuffle), drop_last=True)
    num_workers = int(data_cfg.num_workers)
    train = InfiniteLoader(DataLoader(train_ds, batch_size=batch_size, sampler=sampler, drop_last=True,
                                      num_workers=num_workers, persistent_workers=num_workers > 0))
    val = None
    if val_ds is not None:
        per_rank = len(val_ds) // dp_size
        if per_rank == 0:
            raise DataError(f"data.val_fraction={val_fraction} gives {len(val_ds)} validation {unit} "
                            f"of seq_len {seq_len}, fewer than the {dp_size} data-parallel ranks; "
                            "raise data.val_fraction")
        # Equal counts on every rank: under DDP, uneven eval batches would hang a collective.
        shard = Subset(val_ds, range(dp_rank, per_rank * dp_size, dp_size))
        val = DataLoader(shard, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    log.info("data: %s tokens from %s; %d train %s (%d batches/rank/epoch), %d val; "
             "seq_len %d, tokenizer %s", f"{len(tokens):,}", data_cfg.path or "the built-in corpus",
             len(train_ds), unit, train.batches_per_epoch, 0 if val is None else len(val.dataset) * dp_size,
             seq_len, tokenizer.spec)
    return train, val, tokenizer
