"""meshrun.data in one process: tokenizers, token files and their corruption, windows, sampler, loaders, CLI."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from meshrun.cli import data as data_cli
from meshrun.data import (
    ByteTokenizer,
    InfiniteLoader,
    ResumableDistributedSampler,
    TokenWindowDataset,
    build_loaders,
    load_corpus_text,
    load_tokenizer,
    open_token_dir,
    open_tokens,
    prepare_tokens,
    split_tokens,
)
from meshrun.data.tokens import dtype_for_vocab
from meshrun.errors import DataError

TEXT = "The quick brown fox jumps over the lazy dog.\nÜnïcödé, 中文 and emoji 🙂 too.\n"


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg, msg
    assert exc.value.exit_code == 2
    return msg


def cfg(**kw) -> SimpleNamespace:
    base = dict(path="", tokenizer="byte", seq_len=32, val_fraction=0.1, shuffle=True, num_workers=0)
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "a.txt"
    path.write_text(TEXT * 40, encoding="utf-8")
    return path


@pytest.fixture
def token_dir(tmp_path: Path, text_file: Path) -> Path:
    out = tmp_path / "tok"
    prepare_tokens([text_file], out, ByteTokenizer())
    return out


# -- tokenizers ------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size == 259 and tok.eos_id == 256 and tok.spec == "byte"
    ids = tok.encode(TEXT)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(TEXT.encode())
    assert tok.decode(ids) == TEXT
    assert tok.decode(tok.encode("ab") + [tok.eos_id] + tok.encode("c")) == "ab<eos>c"
    with pytest.raises(ValueError):
        tok.decode([999])


def test_load_tokenizer_specs(tmp_path: Path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(""), ByteTokenizer)
    with pytest.raises(DataError) as exc:
        load_tokenizer(tmp_path / "nope.json")
    assert "nope.json" in one_line(exc) and "never downloads" in str(exc.value)


def test_tokenizer_json_without_package_says_pip_install(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed: `import tokenizers` fails
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError) as exc:
        load_tokenizer(tmp_path / "tokenizer.json")
    assert "pip install tokenizers" in one_line(exc)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed")
def test_tokenizer_json_round_trip(tmp_path: Path, text_file: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *sorted(set(TEXT.split()))])}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.vocab_size == len(vocab) and tok.eos_id == 1
    assert tok.decode(tok.encode("quick brown fox")) == "quick brown fox"
    meta = prepare_tokens([text_file], tmp_path / "hf", tok)
    assert meta.tokenizer["sha256"] and meta.vocab_size == len(vocab)
    with pytest.raises(DataError) as exc:  # prepared with tokenizer.json, trained with "byte"
        build_loaders(cfg(path=str(tmp_path / "hf"), seq_len=4), batch_size=1, dp_rank=0, dp_size=1, seed=0)
    assert "data.tokenizer" in one_line(exc)


# -- token files -----------------------------------------------------------------------------------


def test_prepare_and_open(tmp_path: Path, text_file: Path):
    other = tmp_path / "b.txt"
    other.write_text("second file", encoding="utf-8")
    meta = prepare_tokens([text_file, other], tmp_path / "out", ByteTokenizer(), val_fraction=0.25)
    tokens, read = open_token_dir(tmp_path / "out", vocab_size=259)
    expected = ByteTokenizer().encode(text_file.read_text()) + [256] + ByteTokenizer().encode("second file") + [256]
    assert tokens.dtype == torch.uint16 and tokens.to(torch.int64).tolist() == expected
    assert read == meta and meta.num_tokens == len(expected) and meta.val_fraction == 0.25
    assert [s["num_tokens"] for s in meta.sources] == [len(expected) - 12, 12]
    raw = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert raw["format"] == "meshrun-tokens" and raw["version"] == 1 and len(raw["sha256"]) == 64
    assert not list((tmp_path / "out").glob("*.tmp"))


class WideTokenizer(ByteTokenizer):
    """A vocab over 65536, to force uint32 token files."""

    @property
    def vocab_size(self) -> int:
        return 70_000

    def encode(self, text: str) -> list[int]:
        return [b + 65_600 for b in text.encode()]

    @property
    def spec(self) -> str:
        return "wide"


def test_uint32_for_large_vocabs(tmp_path: Path, text_file: Path):
    assert dtype_for_vocab(65_536) == "uint16" and dtype_for_vocab(65_537) == "uint32"
    prepare_tokens([text_file], tmp_path / "w", WideTokenizer())
    tokens = open_tokens(tmp_path / "w")
    assert tokens.dtype == torch.uint32 and int(tokens[0]) == ord("T") + 65_600


def _truncate(d: Path):
    bin_path = d / "tokens.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-6])


def _flip(d: Path):
    data = bytearray((d / "tokens.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "tokens.bin").write_bytes(bytes(data))


def _meta(d: Path, edit):
    meta = json.loads((d / "meta.json").read_text())
    edit(meta)
    (d / "meta.json").write_text(json.dumps(meta))


CORRUPTIONS = {
    "truncated bin": (_truncate, "expected"),
    "flipped byte": (_flip, "sha256 does not match"),
    "meta not json": (lambda d: (d / "meta.json").write_text("{not json"), "not valid JSON"),
    "meta not ours": (lambda d: (d / "meta.json").write_text("[1, 2]"), "not a meshrun token meta"),
    "meta missing key": (lambda d: _meta(d, lambda m: m.pop("num_tokens")), "num_tokens"),
    "meta bad dtype": (lambda d: _meta(d, lambda m: m.update(dtype="float32")), "dtype"),
    "meta wrong count": (lambda d: _meta(d, lambda m: m.update(num_tokens=m["num_tokens"] + 1)), "expected"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_token_files_are_one_line_errors(token_dir: Path, case: str):
    damage, words = CORRUPTIONS[case]
    damage(token_dir)
    with pytest.raises(DataError) as exc:
        open_tokens(token_dir)
    msg = one_line(exc)
    assert msg.startswith("corrupt token file ") and words in msg and "re-run meshrun data prepare" in msg


def test_truncated_message_gives_both_sizes(token_dir: Path):
    size = (token_dir / "tokens.bin").stat().st_size
    _truncate(token_dir)
    with pytest.raises(DataError, match=f"expected {size} bytes .* found {size - 6}"):
        open_tokens(token_dir)


def test_sampled_and_no_verification(token_dir: Path):
    _flip(token_dir)
    with pytest.raises(DataError, match="sampled sha256"):
        open_tokens(token_dir, verify="sample")
    assert len(open_tokens(token_dir, verify="none")) > 0  # size-only check lets a flipped byte pass


@pytest.mark.parametrize("missing", ["dir", "tokens.bin", "meta.json"])
def test_missing_paths_name_the_fix(token_dir: Path, missing: str):
    target = token_dir if missing == "dir" else token_dir / missing
    if missing == "dir":
        target = token_dir.parent / "absent"
    else:
        target.unlink()
    with pytest.raises(DataError) as exc:
        open_tokens(target if missing == "dir" else token_dir)
    msg = one_line(exc)
    assert str(target) in msg and "run: meshrun data prepare FILE --out" in msg


def test_vocab_larger_than_model(token_dir: Path):
    with pytest.raises(DataError) as exc:
        open_tokens(token_dir, vocab_size=100)
    assert "vocab_size 259" in one_line(exc) and "100" in str(exc.value)


def test_prepare_rejects_bad_input(tmp_path: Path):
    with pytest.raises(DataError, match="does not exist"):
        prepare_tokens([tmp_path / "nope.txt"], tmp_path / "o", ByteTokenizer())
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DataError, match="not UTF-8"):
        prepare_tokens([tmp_path / "bin.txt"], tmp_path / "o", ByteTokenizer())


# -- windows and split -----------------------------------------------------------------------------


def test_token_windows():
    tokens = torch.arange(21, dtype=torch.int64).to(torch.uint16)
    ds = TokenWindowDataset(tokens, seq_len=4)
    assert len(ds) == 5  # starts 0, 4, 8, 12, 16; the last needs tokens 16..20
    x, y = ds[1]
    assert x.dtype == torch.int64 and x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    assert ds[-1][1].tolist() == [17, 18, 19, 20]
    with pytest.raises(IndexError):
        ds[5]
    assert len(TokenWindowDataset(tokens, seq_len=4, stride=2)) == 9
    assert len(TokenWindowDataset(tokens[:4], seq_len=4)) == 0


def test_split_is_contiguous_held_out_tail():
    tokens = torch.arange(100)
    train, val = split_tokens(tokens, 0.2, seq_len=8)
    assert train.tolist() == list(range(80)) and val.tolist() == list(range(80, 100))
    assert split_tokens(tokens, 0.0, seq_len=8)[1] is None
    with pytest.raises(DataError, match="use data.val_fraction between 0.09 and 0.91, or 0"):
        split_tokens(tokens, 0.05, seq_len=8)
    train, val = split_tokens(tokens, 0.09, seq_len=8)  # the advised bound itself works
    assert len(val) == 9 and len(train) == 91
    with pytest.raises(DataError, match="use more data or data.seq_len=99 or less"):
        split_tokens(tokens, 0.0, seq_len=200)
    # too few tokens for both sides: no val_fraction helps, so none is advised
    with pytest.raises(DataError, match=r"13 tokens: training and evaluation each need .* data.seq_len=5 or less"):
        split_tokens(torch.arange(13), 0.05, seq_len=32)


# -- sampler ---------------------------------------------------------------------------------------


def epoch_of(samplers: list[ResumableDistributedSampler]) -> list[list[int]]:
    return [list(s) for s in samplers]


@pytest.mark.parametrize("n", [100, 103])
def test_sampler_ranks_are_disjoint_and_complete(n: int):
    ranks = epoch_of([ResumableDistributedSampler(n, 4, r, seed=1) for r in range(4)])
    seen = [i for r in ranks for i in r]
    assert len(set(seen)) == len(seen) == n - n % 4  # drop_last drops only the last n % 4
    assert {len(r) for r in ranks} == {n // 4}


def test_sampler_reshuffles_each_epoch_by_itself():
    s = ResumableDistributedSampler(50, 2, 0, seed=3)
    first, second = list(s), list(s)  # no set_epoch between the passes
    assert s.epoch == 2 and first != second and len(first) == len(second) == 25
    peer = ResumableDistributedSampler(50, 2, 1, seed=3)
    list(peer)
    assert sorted(second + list(peer)) == list(range(50))
    again = ResumableDistributedSampler(50, 2, 0, seed=3)
    assert list(again) == first  # deterministic for a seed


def test_sampler_set_epoch_compat_and_no_shuffle():
    s = ResumableDistributedSampler(10, 2, 1, seed=0, shuffle=False)
    assert list(s) == [1, 3, 5, 7, 9]
    s.set_epoch(1)  # the epoch it is already in: keeps the position
    assert s.epoch == 1 and s.consumed == 0
    s.set_epoch(7)
    assert s.state_dict()["epoch"] == 7
    t = ResumableDistributedSampler(10, 3, 2, shuffle=False, drop_last=False)
    assert len(t) == 4 and list(t) == [2, 5, 8, 1]  # padded from the start of the pass


def test_sampler_resumes_exactly_mid_epoch():
    ref = [ResumableDistributedSampler(40, 2, r, seed=5) for r in range(2)]
    full = [list(s) + list(s) for s in ref]  # epochs 0 and 1
    run = [ResumableDistributedSampler(40, 2, r, seed=5) for r in range(2)]
    its = [iter(s) for s in run]
    head = [[next(it) for _ in range(7)] for it in its]
    state = run[0].state_dict()
    assert state["epoch"] == 0 and state["consumed"] == 14 and state == run[1].state_dict()
    resumed = [ResumableDistributedSampler(40, 2, r, seed=99) for r in range(2)]
    for s in resumed:
        s.load_state_dict(state)  # the saved seed wins over the new one
    tails = [list(s) + list(s) for s in resumed]
    for r in range(2):
        assert head[r] + tails[r] == full[r]


@pytest.mark.parametrize(("before", "after"), [(4, 3), (2, 1), (1, 4), (3, 2)])
def test_sampler_resume_with_other_rank_count_is_exactly_once(before: int, after: int):
    n, k = 101, 5
    run = [ResumableDistributedSampler(n, before, r, seed=2) for r in range(before)]
    its = [iter(s) for s in run]
    seen = [next(it) for it in its for _ in range(k)]
    state = run[0].state_dict()
    assert state["consumed"] == before * k
    resumed = [ResumableDistributedSampler(n, after, r, seed=2) for r in range(after)]
    for s in resumed:
        s.load_state_dict(state)
    rest = [i for s in resumed for i in list(s)]
    everything = seen + rest
    assert len(set(everything)) == len(everything)  # nothing twice
    assert len(everything) > n - after  # nothing lost but the drop_last tail (< after items)
    assert all(s.epoch == 1 for s in resumed)


def test_sampler_state_for_other_dataset_is_rejected():
    state = ResumableDistributedSampler(10, 1, 0).state_dict()
    with pytest.raises(DataError, match="10 samples"):
        ResumableDistributedSampler(11, 1, 0).load_state_dict(state)


def test_sampler_with_any_map_style_dataset():
    ds = TensorDataset(torch.arange(30).float(), torch.arange(30))
    sampler = ResumableDistributedSampler(len(ds), 3, 2, seed=0)
    batches = [b[1].tolist() for b in DataLoader(ds, batch_size=4, sampler=sampler, drop_last=True)]
    assert len(batches) == 2 and sampler.epoch == 1


# -- InfiniteLoader and build_loaders --------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_infinite_loader_state_is_exact_despite_prefetch(num_workers: int):
    ds = TensorDataset(torch.arange(37))

    def make():
        sampler = ResumableDistributedSampler(len(ds), 1, 0, seed=4)
        return InfiniteLoader(DataLoader(ds, batch_size=5, sampler=sampler, drop_last=True,
                                         num_workers=num_workers))

    ref_loader = make()
    ref = [next(ref_loader)[0].tolist() for _ in range(20)]  # 7 batches/epoch: crosses 2 epochs
    assert ref[:7] != ref[7:14] and ref_loader.epoch == 2
    loader = make()
    head = [next(loader)[0].tolist() for _ in range(9)]
    state = loader.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 10)  # counts delivered, not prefetched
    if num_workers:
        assert loader.sampler.state_dict()["consumed"] > 10  # the workers did fetch ahead
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [next(resumed)[0].tolist() for _ in range(11)] == ref


def test_build_loaders_on_builtin_corpus():
    train, val, tok = build_loaders(cfg(), seq_len=64, batch_size=4, dp_rank=1, dp_size=2, seed=0,
                                    vocab_size=259)
    x, y = next(train)
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < tok.vocab_size
    assert train.state_dict()["consumed"] == 8 and train.batches_per_epoch > 100
    _, val0, _ = build_loaders(cfg(), seq_len=64, batch_size=4, dp_rank=0, dp_size=2, seed=0)
    assert len(val.dataset) == len(val0.dataset) > 0  # equal val share per rank


def test_corpus_is_real_prose_of_the_promised_size():
    text = load_corpus_text()
    assert 500_000 <= len(text.encode()) <= 2_000_000
    assert text.isascii() and text.count(" the ") > 5000


def test_build_loaders_from_text_file_and_token_dir(text_file: Path, token_dir: Path):
    a, _, _ = build_loaders(cfg(path=str(text_file), shuffle=False), batch_size=2, dp_rank=0,
                            dp_size=1, seed=0)
    b, _, _ = build_loaders(cfg(path=str(token_dir), shuffle=False), batch_size=2, dp_rank=0,
                            dp_size=1, seed=0)
    assert torch.equal(next(a)[0], next(b)[0])
    assert next(b)[0][0].tolist() == list((TEXT * 40).encode())[64:96]  # 2nd batch: window 2


def test_build_loaders_errors(tmp_path: Path, text_file: Path):
    with pytest.raises(DataError) as exc:
        build_loaders(cfg(path=str(tmp_path / "missing.txt")), batch_size=2, dp_rank=0, dp_size=1, seed=0)
    assert "missing.txt" in one_line(exc) and "meshrun data prepare" in str(exc.value)
    with pytest.raises(DataError, match="less than one batch per rank"):
        build_loaders(cfg(path=str(text_file), val_fraction=0.0), seq_len=512, batch_size=8,
                      dp_rank=0, dp_size=2, seed=0)
    with pytest.raises(DataError, match="model's vocab_size 100"):
        build_loaders(cfg(), batch_size=2, dp_rank=0, dp_size=1, seed=0, vocab_size=100)


# -- CLI -------------------------------------------------------------------------------------------


def test_cli_prepare(tmp_path: Path, text_file: Path, capsys):
    assert data_cli.main(["prepare", str(text_file), "--out", str(tmp_path / "d"), "--val-fraction", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "tokens (uint16" in out and "data.path=" in out
    assert len(open_tokens(tmp_path / "d")) == len(text_file.read_bytes()) + 1


def test_cli_errors_exit_2(tmp_path: Path, capsys):
    assert data_cli.main(["prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshrun data: error: ") and err.count("\n") == 1 and "nope.txt" in err
    assert data_cli.main(["prepare", str(tmp_path / "x"), "--out", "d", "--tokenizer", "no/tok.json"]) == 2
    for argv in (["prepare", "f.txt"], ["prepare", "f.txt", "--out", "d", "--val-fraction", "2"], []):
        with pytest.raises(SystemExit) as exc:
            data_cli.main(argv)
        assert exc.value.code == 2
