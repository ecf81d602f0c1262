"""`data.packing = true`: whole examples packed into sequences of seq_len, each attending only to itself.

    ds = PackedExampleDataset(tokens, loss_mask, bounds, seq_len=512)   # bounds: open_examples(DIR, meta)
    inputs, targets, positions = ds[0]          # each (seq_len,) int64
    documents = document_ids(positions[None])  # (1, seq_len): the example index of every column

An example of n tokens takes n - 1 columns: its tokens but the last as inputs, its tokens but the
first as targets (a target whose loss-mask byte is 0 is -100, IGNORE_INDEX), and positions 0..n-2.
Examples are packed in file order, as many as fit, into one sequence (next-fit, as torchtune's
PackedDataset); the rest of a sequence is padding: inputs 0, targets -100, positions 0..k-1 (a
document of its own, never attended to by an example). The model keeps attention inside each
example: the built-in one with a block-causal mask from `document_ids`, a Hugging Face model
with transformers' own packed-sequence mask, found from the same positions
(transformers.masking_utils.find_packed_sequence_indices: a new document wherever the position
does not rise by 1).

The packing depends only on the data and seq_len, so the sampler's unit is a packed sequence, and
exactly-once sampling and resharded resume hold for sequences as they do for windows. An example
longer than seq_len + 1 tokens is refused in one line (never truncated).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from meshrun.data.tokens import IGNORE_INDEX
from meshrun.errors import DataError


def pack_examples(bounds: torch.Tensor, seq_len: int, *, one_per_sequence: bool = False) -> torch.Tensor:
    """The first example of every packed sequence, plus the end: sequence i holds examples
    [starts[i], starts[i+1]). `bounds`: the examples' token offsets plus the end (int64).

    Next-fit in file order: an example joins the current sequence when its n - 1 columns fit in
    what is left of seq_len, else it starts the next one. one_per_sequence: every example alone,
    padded to seq_len (what padding without packing costs; benchmarks/packing.py compares them).
    """
    columns = (bounds[1:] - bounds[:-1] - 1).clamp(min=0)
    too_long = columns > seq_len
    if bool(too_long.any()):
        n = int(too_long.sum())
        raise DataError(f"data.packing=true: {n} example(s) are longer than data.seq_len={seq_len} + 1 tokens "
                        f"(the longest has {int(columns.max()) + 1}); raise data.seq_len to {int(columns.max())} "
                        f"or re-prepare with --max-len {seq_len + 1}")
    if one_per_sequence:
        return torch.arange(len(columns) + 1)
    starts, used = [0], 0
    for i, n in enumerate(columns.tolist()):
        if used + n > seq_len:
            starts.append(i)
            used = 0
        used += n
    starts.append(len(columns))
    return torch.tensor(starts, dtype=torch.int64)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) positions -> (B, T) document index of each column: a new document wherever the
    position does not rise by 1 (transformers' find_packed_sequence_indices, so the built-in model
    and a Hugging Face one split a packed row the same way)."""
    step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


class PackedExampleDataset(Dataset):
    """Packed sequences of the examples [first, last) of a chat / prompt-completion token directory.

    tokens, loss_mask: the directory's arrays (memory-mapped; only what is read is loaded).
    bounds: every example's start offset plus the end (`meshrun.data.tokens.open_examples`).
    first, last: the examples this dataset packs (the train or the held-out part).
    Item i is (inputs, targets, positions), each (seq_len,) int64.
    """

    masked = True  # padding and untrained targets are -100: the step averages over trained tokens

    def __init__(self, tokens: torch.Tensor, loss_mask: torch.Tensor, bounds: torch.Tensor, seq_len: int, *,
                 first: int = 0, last: int | None = None, one_per_sequence: bool = False):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        last = len(bounds) - 1 if last is None else last
        self.tokens, self.loss_mask, self.seq_len = tokens, loss_mask, seq_len
        self.bounds = bounds[first : last + 1]
        self.starts = pack_examples(self.bounds, seq_len, one_per_sequence=one_per_sequence)
        if len(self.bounds) < 2:  # no example: no sequence
            self.starts = self.starts[:1]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def examples(self, index: int) -> list[tuple[int, int]]:
        """(start, end) token offsets of the examples in sequence `index`."""
        lo, hi = int(self.starts[index]), int(self.starts[index + 1])
        b = self.bounds[lo : hi + 1].tolist()
        return list(zip(b[:-1], b[1:], strict=True))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"packed sequence {index} out of range for {len(self)}")
        index %= len(self)
        inputs = torch.zeros(self.seq_len, dtype=torch.int64)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.int64)
        positions = torch.empty(self.seq_len, dtype=torch.int64)
        at = 0
        for start, end in self.examples(index):
            n = end - start - 1
            if n <= 0:
                continue
            chunk = self.tokens[start:end].to(torch.int64)
            trained = self.loss_mask[start + 1 : end].bool()
            inputs[at : at + n] = chunk[:-1]
            targets[at : at + n] = chunk[1:].masked_fill(~trained, IGNORE_INDEX)
            positions[at : at + n] = torch.arange(n)
            at += n
        positions[at:] = torch.arange(self.seq_len - at)  # padding: a document of its own
        return inputs, targets, positions


def packed_split(tokens: torch.Tensor, loss_mask: torch.Tensor, bounds: torch.Tensor, seq_len: int, *,
                 n_train: int) -> tuple[PackedExampleDataset, PackedExampleDataset | None]:
    """(train, held-out) packed datasets: the examples that start in the first `n_train` tokens
    (the split of meshrun.data.split, moved to the next example boundary), and the rest (None
    when there are no held-out tokens)."""
    n_examples = len(bounds) - 1
    first_val = int(torch.searchsorted(bounds[:-1], n_train))  # examples starting before n_train train
    train = PackedExampleDataset(tokens, loss_mask, bounds, seq_len, last=first_val)
    if n_train >= len(tokens):
        return train, None
    return train, PackedExampleDataset(tokens, loss_mask, bounds, seq_len, first=first_val, last=n_examples)
