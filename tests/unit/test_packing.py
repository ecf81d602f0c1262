"""data.packing: whole examples packed into sequences, attention kept inside each, positions restarting.

No leaks: changing example A of a packed row leaves the per-token losses of the examples beside it
unchanged (within 1e-6), for the built-in model (SDPA with a block-causal mask) and a Hugging Face
Llama (transformers' packed-sequence mask from the position ids, also split into pipeline stages);
without the mask they change, so the check bites. Then the loader (a chat token directory made here with a tokenizer built here):
every train example in exactly one sequence, nothing truncated, exactly-once over an epoch on 2
ranks and after a resume on 1; and the refusals, each one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import save_hf_tokenizer, save_tiny_hf

from meshrun.config.loader import config_from_dict
from meshrun.data.loader import build_loaders, load_examples
from meshrun.data.packing import PackedExampleDataset, document_ids, pack_examples
from meshrun.data.prepare import prepare_tokens
from meshrun.data.prepare_chat import prepare_examples
from meshrun.data.tokenizer import load_tokenizer
from meshrun.data.tokens import (
    IGNORE_INDEX,
    open_examples,
    open_loss_mask,
    open_token_dir,
    read_meta,
)
from meshrun.errors import ConfigError, DataError
from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.resolve import ParallelOptions, resolve_layout

pytestmark = pytest.mark.timeout(60)

SEQ = 24
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def _row(a_seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice]:
    """One packed row of examples A (7 tokens), B (9) and C (6), all trained; A's tokens drawn from
    `a_seed`. Returns (inputs, targets, positions) as (1, SEQ) and B's and C's columns."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (22,), generator=gen)
    tokens[:7] = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(a_seed))
    bounds = torch.tensor([0, 7, 16, 22])
    ds = PackedExampleDataset(tokens, torch.ones(22, dtype=torch.uint8), bounds, SEQ)
    assert len(ds) == 1 and ds.examples(0) == [(0, 7), (7, 16), (16, 22)]
    inputs, targets, positions = (t[None] for t in ds[0])
    assert positions[0].tolist() == [*range(6), *range(8), *range(5), *range(5)]  # 5 columns of padding
    return inputs, targets, positions, slice(6, 19)


def _per_token(model, inputs, targets, positions=None, documents=None) -> torch.Tensor:
    kwargs = {} if positions is None else {"positions": positions, "documents": documents}
    with torch.no_grad():
        logits = model(inputs, **kwargs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none")


def _leak(model) -> tuple[float, float]:
    """(largest change of B's and C's per-token losses when A changes: with the packing mask, without it)."""
    out = []
    for masked in (True, False):
        losses = []
        for seed in (2, 3):
            inputs, targets, positions, others = _row(seed)
            documents = document_ids(positions)
            losses.append(_per_token(model, inputs, targets, *((positions, documents) if masked else ()))[others])
        out.append(float((losses[0] - losses[1]).abs().max()))
    return out[0], out[1]


def test_changing_example_a_leaves_the_other_examples_losses_unchanged_builtin():
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=SEQ), seed=0)
    with_mask, without = _leak(model)
    assert with_mask <= 1e-6
    assert without > 1e-3  # the same check without the mask sees A


def test_changing_example_a_leaves_the_other_examples_losses_unchanged_hf(tmp_path: Path):
    from meshrun.models.hf import build_hf_model
    from meshrun.parallel.pipeline import stage_module

    model = build_hf_model(str(save_tiny_hf(tmp_path / "llama")))
    model.check_packing()  # routes attention through transformers' masks
    with_mask, without = _leak(model)
    assert with_mask <= 1e-6
    assert without > 1e-3
    # pipeline stages: each builds the mask again from the positions it is given (as the schedule does)
    inputs, _, positions, _ = _row(2)
    kwargs = {"positions": positions, "documents": document_ids(positions)}
    with torch.no_grad():
        whole = model(inputs, **kwargs)
        first, last = stage_module(model, 0, 2, ["0"]), stage_module(model, 1, 2, ["1"])
        assert torch.equal(last(first(inputs, **kwargs), **kwargs), whole)
        assert (last(first(inputs)) - whole).abs().max() > 1e-3  # without them: attention across examples


def _chat_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A chat token directory of 60 length-skewed conversations (most short, some long)."""
    tok = save_hf_tokenizer(tmp_path / "tok", ["hello there how are you", "the answer is four"] * 10,
                            config={"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast",
                                    "chat_template": TEMPLATE})
    records = []
    for i in range(60):
        answer = " ".join(["the answer is four"] * (6 if i % 9 == 0 else 1 + i % 3))
        records.append({"messages": [{"role": "user", "content": f"hello {i}"},
                                     {"role": "assistant", "content": answer}]})
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare_examples([src], tmp_path / "chat", load_tokenizer(tok), records_kind="chat", val_fraction=0.1)
    return tmp_path / "chat", tok


def _data_cfg(path: Path, tok: Path, seq_len: int, **kw) -> SimpleNamespace:
    return SimpleNamespace(path=str(path), tokenizer=str(tok), seq_len=seq_len, val_fraction=0.1, shuffle=True,
                           num_workers=0, packing=True, **kw)


def test_packed_loader_covers_every_example_once_and_resumes_on_fewer_ranks(tmp_path: Path):
    out, tok = _chat_dir(tmp_path)
    tokens, meta = open_token_dir(out)
    mask, bounds = open_loss_mask(out, meta), open_examples(out, meta)
    seq_len = 2 * int((bounds[1:] - bounds[:-1]).max())
    loaders = [build_loaders(_data_cfg(out, tok, seq_len), batch_size=1, dp_rank=r, dp_size=2, seed=0)[0]
               for r in range(2)]
    ds = loaders[0].dataloader.dataset
    assert isinstance(ds, PackedExampleDataset) and loaders[0].masked
    n_train = int(ds.bounds[-1])
    # every train example in exactly one sequence, whole: the trained targets are all there
    examples = [e for i in range(len(ds)) for e in ds.examples(i)]
    assert examples == list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=False))[: len(examples)]
    trained = sum(int((ds[i][1] != IGNORE_INDEX).sum()) for i in range(len(ds)))
    assert trained == sum(int(mask[s + 1 : e].sum()) for s, e in examples) > 0
    assert len(ds) < len(examples) / 2  # several examples per sequence
    # one epoch on 2 ranks, checkpointed after 3 batches each, the rest on 1 rank: each sequence once
    seen = []
    for _ in range(3):
        for loader in loaders:
            inputs, targets, positions = next(loader)
            assert inputs.shape == targets.shape == positions.shape == (1, seq_len)
            seen.append(inputs[0])
    state = loaders[0].state_dict()
    alone = build_loaders(_data_cfg(out, tok, seq_len), batch_size=1, dp_rank=0, dp_size=1, seed=0)[0]
    alone.load_state_dict(state)
    seen += [next(alone)[0][0] for _ in range(len(ds) - 6)]
    assert sorted(map(tuple, (x.tolist() for x in seen))) == sorted(tuple(ds[i][0].tolist()) for i in range(len(ds)))
    assert n_train < len(tokens)  # the held-out examples are packed on their own
    val = build_loaders(_data_cfg(out, tok, seq_len), batch_size=1, dp_rank=0, dp_size=1, seed=0)[1]
    assert int(val.dataset.dataset.bounds[0]) == n_train


def test_packing_refusals(tmp_path: Path):
    # layouts and models that cannot keep the mask: one ConfigError line naming the key
    with pytest.raises(ConfigError, match=r"data.packing=true .* parallel.cp=2 .*; set parallel.cp=1"):
        resolve_layout(ParallelOptions(strategy="fsdp", dp_shard=1, cp=2, packing=True), 2)
    with pytest.raises(ConfigError, match="parallel.cp=2"):
        config_from_dict({"data": {"packing": True}, "parallel": {"strategy": "fsdp", "cp": 2}})
    with pytest.raises(ConfigError, match=r"model.factory='m:f' is not known to; set data.packing=false"):
        config_from_dict({"data": {"packing": True}, "model": {"factory": "m:f"}})
    resolve_layout(ParallelOptions(pp=2, packing=True), 2)  # pp carries the mask (tests/distributed)
    # data without examples: text, the built-in corpus
    (tmp_path / "t.txt").write_text("plain text, no examples\n" * 50)
    prepare_tokens([tmp_path / "t.txt"], tmp_path / "text", load_tokenizer("byte"))
    for path in (tmp_path / "text", ""):
        with pytest.raises(DataError, match="has none; prepare one with `meshrun data prepare FILE --format chat"):
            load_examples(str(path))
    # an example longer than a sequence: refused, never truncated
    out, tok = _chat_dir(tmp_path)
    longest = int((lambda b: (b[1:] - b[:-1]).max())(open_examples(out, read_meta(out))))
    with pytest.raises(DataError, match=rf"longer than data.seq_len=8 \+ 1 tokens \(the longest has {longest}\)"):
        build_loaders(_data_cfg(out, tok, 8), batch_size=1, dp_rank=0, dp_size=1, seed=0)
    assert pack_examples(torch.tensor([0, 5, 9]), 4).tolist() == [0, 1, 2]
    assert pack_examples(torch.tensor([0, 5, 9]), 7).tolist() == [0, 2]
