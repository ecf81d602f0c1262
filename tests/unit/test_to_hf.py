"""The HF export mapping and the sampler, in one process: built-in and [model] hf naming, shards, sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import requires

pytestmark = requires("transformers")

from meshrun.errors import ConfigError  # noqa: E402
from meshrun.models.hf_keys import from_hf_key  # noqa: E402
from meshrun.models.llama import ModelArgs, Transformer  # noqa: E402
from meshrun.models.to_hf import hf_run_plan  # noqa: E402
from meshrun.trained.export_hf import check_out, parse_size, plan_shards, write_hf  # noqa: E402
from meshrun.trained.generate import Sampler  # noqa: E402
from meshrun.trained.model_source import ModelSource  # noqa: E402

MODEL = {"name": "tiny", "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64}


def _source(state: dict, config: dict) -> ModelSource:
    specs = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    return ModelSource(Path("mem"), config, None, specs, lambda name: state[name].clone())


def _logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("tied", [False, True])
def test_builtin_export_matches_the_model(tmp_path: Path, tied: bool):
    """q/k rows permuted for HF's rotate-half RoPE, GQA, tied embeddings: logits equal within 1e-5."""
    import transformers

    ours = Transformer(ModelArgs(vocab_size=259, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                 tie_embeddings=tied), seed=3).eval()
    state = {k: v.detach() for k, v in ours.state_dict().items()}
    summary = write_hf(_source(state, {"model": {**MODEL, "tie_embeddings": tied}}), tmp_path / "hf", max_bytes=8000)
    assert summary["shards"] > 3 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    tokens = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    assert (_logits(ours, tokens) - _logits(theirs, tokens)).abs().max().item() < 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert tok("héllo")["input_ids"] == list("héllo".encode()) and tok.eos_token_id == 256


def test_hf_run_names_go_through_hf_keys(tmp_path: Path):
    """A [model] hf run's tensors (model.<adapter name>) come back under HF names with DIR's config.json."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path / "base")
    state = {from_hf_key(k): v.detach() for k, v in ref.state_dict().items()}  # the adapter's names
    assert "layers.0.self_attn.q_proj.weight" in state
    write_hf(_source(state, {"model": {"hf": str(tmp_path / "base")}}), tmp_path / "out", max_bytes=10**9)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as HF writes it
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (tmp_path / "base" / "config.json").read_text())
    with pytest.raises(ConfigError, match="not a name of meshrun's Hugging Face adapter"):
        hf_run_plan({"blocks.0.wq.weight": ((4, 4), torch.float32)}, str(tmp_path / "base"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    tokens = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(ref, tokens), _logits(back, tokens))


def test_sizes_shards_and_out_dir(tmp_path: Path):
    assert parse_size("2GB") == 2 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("1GiB") == 2**30
    assert parse_size("4096") == 4096
    for bad in ("", "2XB", "-1MB", "0"):
        with pytest.raises(ConfigError, match="--max-shard-size"):
            parse_size(bad)
    assert plan_shards({"a": 4, "b": 4, "c": 9, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]
    (tmp_path / "x").mkdir()
    check_out(tmp_path / "x", force=False)  # empty: fine
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--force"):
        check_out(tmp_path / "x", force=False)
    check_out(tmp_path / "x", force=True)


def test_force_replaces_an_export_and_keeps_other_files(tmp_path: Path):
    ours = Transformer(ModelArgs(vocab_size=259, dim=32, n_layers=1, n_heads=4, ffn_hidden=64), seed=1)
    source = _source({k: v.detach() for k, v in ours.state_dict().items()}, {"model": {**MODEL, "n_layers": 1,
                                                                                       "n_kv_heads": 4}})
    out = tmp_path / "hf"
    write_hf(source, out, max_bytes=4000)
    assert len(list(out.glob("model-*.safetensors"))) > 2
    (out / "notes.txt").write_text("mine")
    write_hf(source, out, max_bytes=10**9)
    assert sorted(p.name for p in out.glob("model-*")) == ["model-00001-of-00001.safetensors"]
    assert (out / "notes.txt").read_text() == "mine" and not list(tmp_path.glob(".hf.tmp-*"))


def test_sampler_filters_and_seed():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    draw = [Sampler(temperature=1.0, top_k=2).pick(logits, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draw) == {1, 3}
    assert Sampler(temperature=0).pick(logits, torch.Generator()) == 1
    assert {Sampler(top_p=0.01).pick(logits, torch.Generator().manual_seed(s)) for s in range(10)} == {1}
    same = [Sampler(temperature=1.0).pick(logits, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(same)) == 1
    for kwargs, flag in (({"max_new_tokens": 0}, "--max-new-tokens"), ({"temperature": -1}, "--temperature"),
                         ({"top_k": -2}, "--top-k"), ({"top_p": 1.5}, "--top-p"), ({"seed": -1}, "--seed"),
                         ({"temperature": float("nan")}, "--temperature")):
        with pytest.raises(ConfigError, match=flag):
            Sampler(**kwargs)
