"""Chat and prompt-completion data: per-token loss masks from a tokenizer's own chat template, the
format-2 token directory, the -100 targets, and a loss averaged over trained tokens.

The tokenizer is made here (a tiny byte-level BPE from conftest, with a chat template in its
tokenizer_config.json): no hub, no download.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import save_hf_tokenizer

from meshrun.cli import data as data_cli
from meshrun.data.loader import IGNORE_INDEX, TokenWindowDataset, load_data
from meshrun.data.prepare_chat import prepare_examples
from meshrun.data.tokenizer import load_tokenizer
from meshrun.data.tokens import LOSS_MASK_FILE, open_loss_mask, open_token_dir, read_meta
from meshrun.errors import DataError
from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.layout import BuiltLayout
from meshrun.train.step import layout_step, lm_loss

# A template without {% generation %}: the assistant spans come from rendering prefixes.
PREFIX_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                   "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
# The same rendering, with the assistant spans marked for transformers' return_assistant_tokens_mask.
GENERATION_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                       "{% generation %}{{ m['content'] }}</s>\n{% endgeneration %}{% else %}"
                       "{{ m['content'] }}</s>\n{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
# Rewrites earlier turns (drops every assistant turn but the last): no prefix property.
REWRITING_TEMPLATE = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<s>{{ m['role'] }}\n"
                      "{{ m['content'] }}</s>\n{% endif %}{% endfor %}")
EOS = "<|endoftext|>"
TALK = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                     {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "four"}]}


def _tokenizer(directory: Path, template: str | None = PREFIX_TEMPLATE) -> Path:
    config = {"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    texts = ["hello there how are you", "the answer is four", "user assistant system be brief"] * 10
    return save_hf_tokenizer(directory, texts, config={**config, **({"chat_template": template} if template else {})})


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _trained_text(out: Path, tok_dir: Path) -> tuple[str, str]:
    tokens, meta = open_token_dir(out)
    mask = open_loss_mask(out, meta)
    tok = load_tokenizer(tok_dir)
    ids = tokens.tolist()
    return tok.decode([i for i, m in zip(ids, mask.tolist(), strict=True) if m]), tok.decode(ids)


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("toks")
    return {name: _tokenizer(root / name, t) for name, t in
            (("prefix", PREFIX_TEMPLATE), ("generation", GENERATION_TEMPLATE), ("rewriting", REWRITING_TEMPLATE),
             ("none", None))}


@pytest.mark.parametrize("kind", ["prefix", "generation"])
def test_multi_turn_chat_trains_only_the_assistant_turns(tmp_path: Path, toks, kind: str):
    src = _jsonl(tmp_path / "c.jsonl", [TALK])
    meta = prepare_examples([src], tmp_path / "o", load_tokenizer(toks[kind]), records_kind="chat")
    trained, whole = _trained_text(tmp_path / "o", toks[kind])
    assert whole == ("<s>system\nbe brief</s>\n<s>user\nhello</s>\n<s>assistant\nhi there</s>\n"
                     f"<s>user\n2+2?</s>\n<s>assistant\nfour</s>\n{EOS}")
    assert trained == f"hi there</s>\nfour</s>\n{EOS}"  # both turns, their end marks, the closing eos
    assert meta.version == 2 and meta.records == "chat" and meta.examples["count"] == 1
    assert read_meta(tmp_path / "o").loss_mask["num_trained"] == meta.loss_mask["num_trained"]


def test_train_on_prompt_and_prompt_completion(tmp_path: Path, toks):
    tok = load_tokenizer(toks["prefix"])
    prepare_examples([_jsonl(tmp_path / "c.jsonl", [TALK])], tmp_path / "all", tok, records_kind="chat",
                     train_on="prompt")
    trained, whole = _trained_text(tmp_path / "all", toks["prefix"])
    assert trained == whole
    pc = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": " four"}, {"prompt": "hi", "completion": ""}])
    meta = prepare_examples([pc], tmp_path / "pc", tok, records_kind="prompt-completion")
    trained, whole = _trained_text(tmp_path / "pc", toks["prefix"])
    assert (whole, trained) == (f"2+2= four{EOS}", f" four{EOS}")
    assert meta.skipped == {"empty": 1}


def test_skipped_records_are_counted_and_reported(tmp_path: Path, toks, capsys):
    long = {"messages": [{"role": "user", "content": "hello " * 100}, {"role": "assistant", "content": "four"}]}
    records = [TALK, long, {"messages": []}, {"messages": [{"role": "narrator", "content": "x"}]},
               {"messages": [{"role": "user", "content": "hello"}]}]
    src = _jsonl(tmp_path / "c.jsonl", records)
    code = data_cli.main(["prepare", str(src), "--format", "chat", "--tokenizer", str(toks["prefix"]),
                          "--out", str(tmp_path / "o"), "--max-len", "80"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "in 1 chat examples" in out
    assert ("skipped: 1 longer than --max-len 80, 1 empty, 1 with an unknown role ('narrator'), "
            "1 without an assistant turn") in out
    meta = read_meta(tmp_path / "o")
    assert meta.skipped == {"too_long": 1, "empty": 1, "unknown_role": 1, "no_assistant": 1,
                            "unknown_roles": {"narrator": 1}}


@pytest.mark.parametrize(("records", "args", "message"), [
    ([{"text": "x"}], [], "line 1 has no field 'messages'"),
    ([{"messages": "hello"}], [], "'messages' holds a str, not a list"),
    ([{"messages": [{"content": "x"}]}], [], "message 0 is not an object with a 'role'"),
    ([{"messages": [{"role": "user", "content": "x"}]}], [], "give no trained token"),
    ([TALK, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2}],
     ["--tokenizer-kind", "rewriting"], "line 1: this chat template does not render the first 3 message(s)"),
    ([TALK], ["--tokenizer-kind", "none"], "has no chat template"),
    ([{"prompt": "x"}], ["--format", "prompt-completion"], "has no field 'completion'"),
])
def test_bad_chat_input_is_one_line_exit_2(tmp_path: Path, toks, capsys, records, args, message):
    kind = args[args.index("--tokenizer-kind") + 1] if "--tokenizer-kind" in args else "prefix"
    args = [a for a in args if a not in ("--tokenizer-kind", kind)] or ["--format", "chat"]
    src = _jsonl(tmp_path / "c.jsonl", records)
    code = data_cli.main(["prepare", str(src), "--tokenizer", str(toks[kind]), "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()  # nothing left behind


def test_a_text_input_or_a_damaged_mask_is_refused(tmp_path: Path, toks):
    tok = load_tokenizer(toks["prefix"])
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(DataError, match="read records"):
        prepare_examples([tmp_path / "a.txt"], tmp_path / "o", tok, records_kind="chat")
    prepare_examples([_jsonl(tmp_path / "c.jsonl", [TALK])], tmp_path / "o", tok, records_kind="chat")
    (tmp_path / "o" / LOSS_MASK_FILE).write_bytes(b"\1" * (tmp_path / "o" / LOSS_MASK_FILE).stat().st_size)
    with pytest.raises(DataError, match="loss_mask.bin: sha256 does not match"):
        load_data(str(tmp_path / "o"), tok)


def test_window_targets_are_minus_100_where_the_mask_is_0():
    tokens = torch.arange(10)
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 0, 1, 1, 1], dtype=torch.uint8)
    x, y = TokenWindowDataset(tokens, 4, loss_mask=mask)[0]
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [-100, 2, 3, -100]
    assert TokenWindowDataset(tokens, 4)[0][1].tolist() == [1, 2, 3, 4]  # no mask: as before


def _model() -> Transformer:
    return Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32, max_seq_len=8), seed=3)


def _loss_and_grads(model: Transformer, inputs, targets) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = lm_loss(model, inputs, targets)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def test_changing_prompt_targets_changes_nothing_and_an_assistant_target_changes_both():
    """The acceptance check, with the inputs (the context the model reads) fixed: every target of
    a prompt position changed (then masked as the loader masks it) leaves the loss and every
    gradient bit for bit as they were; one assistant target changed changes them."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (4 * 9,), generator=gen)
    mask = (torch.rand(4 * 9, generator=gen) < 0.4).to(torch.uint8)
    data = TokenWindowDataset(tokens, 8, stride=9, loss_mask=mask)
    inputs, targets = (torch.stack(t) for t in zip(*(data[i] for i in range(4)), strict=True))
    changed = (tokens + 1) % 32
    other = TokenWindowDataset(torch.where(mask.bool(), tokens, changed), 8, stride=9, loss_mask=mask)
    other_targets = torch.stack([other[i][1] for i in range(4)])
    assert torch.equal(other_targets, targets)  # what the loss sees is the same ...
    raw_other = torch.stack([TokenWindowDataset(changed, 8, stride=9)[i][1] for i in range(4)])
    assert not torch.equal(raw_other[targets == IGNORE_INDEX], torch.stack(
        [TokenWindowDataset(tokens, 8, stride=9)[i][1] for i in range(4)])[targets == IGNORE_INDEX])  # ... not the ids
    model = _model()
    loss, grads = _loss_and_grads(model, inputs, targets)
    loss2, grads2 = _loss_and_grads(model, inputs, other_targets)
    assert loss == loss2 and all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))
    assistant = (targets != IGNORE_INDEX).nonzero()[0]
    moved = targets.clone()
    moved[tuple(assistant)] = (moved[tuple(assistant)] + 1) % 32
    loss3, grads3 = _loss_and_grads(model, inputs, moved)
    assert loss3 != loss and not torch.equal(grads3[0], grads[0])


def test_the_step_averages_over_trained_tokens_not_over_micro_batches():
    """grad_accum 2 with 1 and 9 trained targets gives the gradient of one batch of both:
    the sum over the 10 trained tokens / 10 (a mean of the two means would weight the 1 by 5)."""
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 32, (2, 8), generator=gen)
    targets = torch.randint(0, 32, (2, 8), generator=gen)
    targets[0, 1:] = IGNORE_INDEX  # micro-batch 0: 1 trained target; micro-batch 1: all 8
    targets[1, 0] = IGNORE_INDEX
    norms = []
    for accum, batches in ((1, [(inputs, targets)]), (2, [(inputs[:1], targets[:1]), (inputs[1:], targets[1:])])):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        layout = BuiltLayout([model], dp_rank=0, dp_size=1, device=torch.device("cpu"))
        loss, norm, _ = layout_step(layout, [opt], iter(batches), grad_accum=accum, dtype="fp32", grad_clip=0.0,
                                    masked=True)
        norms.append((float(loss), float(norm)))
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    model = _model()
    assert norms[0][0] == pytest.approx(float(lm_loss(model, inputs, targets).detach()), rel=1e-6)


def test_parquet_and_save_to_disk_chat_records_give_the_same_tokens_as_jsonl(tmp_path: Path, toks):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"messages": [TALK["messages"]]})
    pq.write_table(table, tmp_path / "c.parquet")
    saved = tmp_path / "saved"  # the layout Dataset.save_to_disk writes: state.json + an Arrow stream
    saved.mkdir()
    with pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    tok = load_tokenizer(toks["prefix"])
    expected = prepare_examples([_jsonl(tmp_path / "c.jsonl", [TALK])], tmp_path / "j", tok, records_kind="chat")
    for src in (tmp_path / "c.parquet", saved):
        got = prepare_examples([src], tmp_path / src.stem, tok, records_kind="chat")
        assert (got.sha256, got.loss_mask["sha256"]) == (expected.sha256, expected.loss_mask["sha256"]), src
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match="has no field 'messages' \\(its fields: 'text'\\); --format chat reads"):
        prepare_examples([tmp_path / "t.parquet"], tmp_path / "t", tok, records_kind="chat")
