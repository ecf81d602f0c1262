"""`meshrun data prepare`'s inputs and Hugging Face tokenizer directories, in one process: each reader
on tiny files, field and split errors, the same bytes for any --workers, progress, missing extras."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import requires, run_proc, save_hf_tokenizer

from meshrun.cli import data as data_cli
from meshrun.data import ByteTokenizer, load_tokenizer, open_token_dir, prepare_tokens
from meshrun.data import sources as sources_mod
from meshrun.data.loader import load_data_tokens
from meshrun.data.prepare_progress import PrepareProgress
from meshrun.errors import DataError

pytestmark = requires("pyarrow", "tokenizers", "datasets")

DOCS = [f"doc {i}: the quick brown fox {'jumps ' * (i % 5)}over the lazy dog, ünïcödé {i}" for i in range(40)]


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg and exc.value.exit_code == 2, msg
    return msg


def byte_ids(docs: list[str]) -> list[int]:
    return [i for d in docs for i in [*d.encode(), 256]]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """DOCS as .txt, .jsonl, .parquet (4 row groups), a Dataset and a DatasetDict saved with `datasets`."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("inputs")
    out = {"txt": root / "a.txt", "jsonl": root / "a.jsonl", "parquet": root / "a.parquet",
           "dataset": root / "ds", "dict": root / "dd"}
    out["txt"].write_text("".join(DOCS), encoding="utf-8")
    out["jsonl"].write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), out["parquet"], row_group_size=10)
    ds = datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))})
    ds.save_to_disk(str(out["dataset"]))
    datasets.DatasetDict({"train": ds.select(range(30)), "test": ds.select(range(30, 40))}).save_to_disk(str(out["dict"]))
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_hf_tokenizer(tmp_path_factory.mktemp("tok"), DOCS, config={
        "bos_token": "<s>", "eos_token": {"content": "</s>", "__type": "AddedToken", "special": True},
        "pad_token": "<pad>"}, special_map={"eos_token": "<|endoftext|>", "unk_token": "<unk>"})


def tokens_of(out: Path) -> list[int]:
    tokens, _ = open_token_dir(out)
    return tokens.to(torch.int64).tolist()


# -- readers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset"])
def test_each_record_reader_gives_one_document_per_record(files, tmp_path: Path, kind: str):
    meta = prepare_tokens([files[kind]], tmp_path / "o", ByteTokenizer())
    assert tokens_of(tmp_path / "o") == byte_ids(DOCS)
    assert meta.sources[0]["num_documents"] == len(DOCS) and meta.sources[0]["text_field"] == "text"


def test_text_file_is_one_document_in_line_cut_pieces(files, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(sources_mod, "TEXT_CHUNK_CHARS", 100)  # many pieces: still one document
    meta = prepare_tokens([files["txt"]], tmp_path / "o", ByteTokenizer())
    assert tokens_of(tmp_path / "o") == byte_ids(["".join(DOCS)]) and meta.sources[0]["format"] == "text"


def test_dataset_dict_split_and_json_lines_details(files, tmp_path: Path):
    meta = prepare_tokens([files["dict"]], tmp_path / "test", ByteTokenizer(), split="test")
    assert tokens_of(tmp_path / "test") == byte_ids(DOCS[30:]) and meta.sources[0]["split"] == "test"
    prepare_tokens([files["dict"]], tmp_path / "train", ByteTokenizer())  # default split: train
    assert tokens_of(tmp_path / "train") == byte_ids(DOCS[:30])
    lines = tmp_path / "b.json"  # .json read as JSON lines; blank lines, "" and null are skipped
    lines.write_text('{"body": "x"}\n\n{"body": ""}\n{"body": null}\n{"body": "yz"}\n')
    prepare_tokens([lines], tmp_path / "b", ByteTokenizer(), text_field="body")
    assert tokens_of(tmp_path / "b") == byte_ids(["x", "yz"])


def test_missing_field_split_and_bad_records_are_one_line(files, tmp_path: Path):
    def error(path, **kw) -> str:
        with pytest.raises(DataError) as exc:
            prepare_tokens([path], tmp_path / "o", ByteTokenizer(), **kw)
        return one_line(exc)

    for kind in ("jsonl", "parquet", "dataset"):
        msg = error(files[kind], text_field="body")
        assert files[kind].name in msg and "'body'" in msg and "'text', 'n'" in msg and "--text-field" in msg
    assert "holds int64, not text" in error(files["parquet"], text_field="n")
    assert "splits train, test, not 'validation'" in error(files["dict"], split="validation")
    late = tmp_path / "late.jsonl"  # the error names the line, even deep in the file
    late.write_text('{"text": "a"}\n' * 3 + '{"txt": "b"}\n')
    assert "late.jsonl line 4 has no field 'text'" in error(late)
    (tmp_path / "arr.json").write_text('[{"text": "a"}]')
    assert "jq -c" in error(tmp_path / "arr.json")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": [1]}\n')
    assert "line 2: field 'text' holds a JSON list" in error(tmp_path / "bad.jsonl")
    (tmp_path / "plain").mkdir()
    assert "not one written by datasets' save_to_disk" in error(tmp_path / "plain")
    assert not (tmp_path / "o" / "tokens.bin.tmp").exists()


# -- workers ---------------------------------------------------------------------------------------


def test_output_is_identical_for_any_number_of_workers(files, tok_dir: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(sources_mod, "BATCH_DOCS", 3)  # many batches, so several are in flight at once
    monkeypatch.setattr(sources_mod, "TEXT_CHUNK_CHARS", 200)
    inputs = [files[k] for k in ("txt", "jsonl", "parquet", "dataset", "dict")]
    tok = load_tokenizer(tok_dir)
    metas = [prepare_tokens(inputs, tmp_path / f"w{n}", tok, workers=n) for n in (1, 2, 3)]
    first = (tmp_path / "w1" / "tokens.bin").read_bytes()
    assert all((tmp_path / f"w{n}" / "tokens.bin").read_bytes() == first for n in (2, 3))
    assert metas[0] == metas[1] == metas[2]
    tail = [i for d in DOCS + DOCS[:30] for i in [*tok.encode(d), tok.eos_id]]  # the Dataset, then the dict's train
    assert tokens_of(tmp_path / "w2")[-len(tail):] == tail
    bad = tmp_path / "bad.jsonl"  # an error raised in a worker is the same one line
    bad.write_text('{"text": "a"}\n' * 10 + "not json\n")
    with pytest.raises(DataError, match="bad.jsonl line 11 is not JSON"):
        prepare_tokens([bad], tmp_path / "bad", tok, workers=2)


# -- tokenizer directories -------------------------------------------------------------------------


def test_tokenizer_directory_special_tokens(tok_dir: Path, files, tmp_path: Path):
    tok = load_tokenizer(tok_dir)
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    # tokenizer_config.json wins over special_tokens_map.json, which fills what it lacks (unk)
    assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.unk_id) == (ids["</s>"], ids["<s>"], ids["<pad>"], ids["<unk>"])
    assert tok.spec == str(tok_dir.resolve()) and [p.name for p in tok.files] == [
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    assert tok.decode(tok.encode(DOCS[3])) == DOCS[3]
    meta = prepare_tokens([files["jsonl"]], tmp_path / "o", tok)
    expected = [i for d in DOCS for i in [*tok.encode(d), ids["</s>"]]]
    assert tokens_of(tmp_path / "o") == expected and meta.tokenizer["eos_id"] == ids["</s>"]
    # a lone tokenizer.json finds its eos by name; same file, other eos: train refuses the data
    lone = load_tokenizer(tok_dir / "tokenizer.json")
    assert lone.eos_id == ids["<|endoftext|>"] and lone.bos_id is None
    with pytest.raises(DataError) as exc:
        load_data_tokens(str(tmp_path / "o"), lone)
    msg = one_line(exc)
    assert f"eos id {ids['</s>']}" in msg and "set data.tokenizer to the one used by prepare" in msg
    assert len(load_data_tokens(str(tmp_path / "o"), tok)[0]) == len(expected)


def test_tokenizer_directory_errors(tmp_path: Path):
    with pytest.raises(DataError) as exc:
        load_tokenizer(tmp_path)
    assert "without tokenizer.json" in one_line(exc)
    with pytest.raises(DataError) as exc:
        load_tokenizer(save_hf_tokenizer(tmp_path / "t1", DOCS, config={"eos_token": "<|im_end|>"}))
    assert "eos_token '<|im_end|>' is not in tokenizer.json's vocabulary" in one_line(exc)
    (tmp_path / "t1" / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(DataError) as exc:
        load_tokenizer(tmp_path / "t1")
    assert "tokenizer_config.json: not valid JSON" in one_line(exc)


# -- progress and CLI ------------------------------------------------------------------------------


def test_progress_redraws_in_a_terminal_and_prints_one_line_in_a_log():
    now = [0.0]
    tty, log = io.StringIO(), io.StringIO()
    bars = [PrepareProgress(workers=2, stream=s, is_tty=t, clock=lambda: now[0]) for s, t in ((tty, True), (log, False))]
    for bar in bars:
        bar.start(1000)
    for step in range(1, 5):
        now[0] = step
        for bar in bars:
            bar.update(step * 250, step * 10, step * 100)
    drawn = tty.getvalue()
    assert drawn.count("\r") >= 4 and "30 docs | 300 tokens | 100 tok/s | 10 docs/s" in drawn
    assert "[###############-----]  75% | elapsed 0:03 | eta 0:01" in drawn
    assert log.getvalue() == ""
    for bar in bars:
        bar.close()
        bar.close()
    assert log.getvalue() == "tokenized 40 documents, 400 tokens in 0:04 (100 tok/s, 10 docs/s, 2 workers)\n"
    assert tty.getvalue().endswith(log.getvalue())


def test_cli_formats_and_workers(files, tok_dir: Path, tmp_path: Path, capsys):
    argv = ["prepare", str(files["jsonl"]), str(files["dict"]), "--split", "test", "--out", str(tmp_path / "d"),
            "--tokenizer", str(tok_dir), "--workers", "2"]
    assert data_cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "from 2 input(s)" in out and f"--set data.tokenizer={tok_dir.resolve()}" in out
    assert err.startswith("tokenized 50 documents") and err.endswith("2 workers)\n")
    for bad in (["--workers", "0"], ["--workers", "x"]):
        with pytest.raises(SystemExit) as exc:
            data_cli.main([*argv, *bad])
        assert exc.value.code == 2


BLOCKER = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('pyarrow', 'tokenizers'):
            raise ModuleNotFoundError(f'No module named {name!r}')
sys.meta_path.insert(0, Blocked())
from meshrun.cli import main
print([main(['data', 'prepare', *a.split('|'), '--out', 'o']) for a in sys.argv[1:]])
"""


def test_missing_extra_is_one_line_naming_it(files, tok_dir: Path, tmp_path: Path):
    (tmp_path / "a.txt").write_text("text")
    args = [str(files["parquet"]), str(files["dataset"]), f"a.txt|--tokenizer|{tok_dir}"]
    result = run_proc([sys.executable, "-c", BLOCKER, *args], cwd=tmp_path, timeout=120)
    assert result.stdout.strip() == "[2, 2, 2]", result.output
    lines = result.stderr.splitlines()
    assert lines == [
        f"meshrun data: error: reading {files['parquet']} needs pyarrow: pip install 'meshrun[hf]'",
        f"meshrun data: error: reading the datasets directory {files['dataset']} needs pyarrow: pip install 'meshrun[hf]'",
        f"meshrun data: error: data.tokenizer={str(tok_dir.resolve())!r} needs tokenizers: pip install 'meshrun[hf]' "
        "(or pip install tokenizers), or use data.tokenizer=\"byte\"",
    ], result.stderr


def test_a_failed_prepare_keeps_the_directory_it_would_replace(tmp_path: Path):
    """A prepare that fails (an input not UTF-8 past its first chunk) leaves an earlier prepared
    --out usable, byte for byte, and removes an --out it created itself; device files are refused."""
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("hello world\n" * 50)
    bad.write_bytes(b"fine text\n" * 5 + b"\xff\xfe")
    out = tmp_path / "tokens"
    prepare_tokens([good], out, ByteTokenizer())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DataError, match="not UTF-8"):
        prepare_tokens([bad], out, ByteTokenizer())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert open_token_dir(out, vocab_size=ByteTokenizer().vocab_size)[1].num_tokens == 600 + 1  # and an eos
    with pytest.raises(DataError, match="not UTF-8"):
        prepare_tokens([bad], tmp_path / "new", ByteTokenizer())
    assert not (tmp_path / "new").exists()
    with pytest.raises(DataError, match="is not a regular file"):
        load_data_tokens("/dev/zero", ByteTokenizer())
