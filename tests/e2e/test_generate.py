"""`meshrun generate`: seeded sampling with a KV cache, greedy decoding, the sources it reads, one-line errors.

The CLI on a run trained by `meshrun train` (2 gloo processes, FSDP 2) is tested in test_hf_export.py,
which trains that run anyway: a second training here would cost the suite ~10 s of CPU. Here the
run directory is written by meshrun's own functions (config.toml, model.pt, finished.json) from an
untrained tiny model, and a checkpoint-free HF directory is exported from it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import meshrun, requires

pytestmark = requires("transformers")

from meshrun.config.dump import save_config  # noqa: E402
from meshrun.config.loader import load_config  # noqa: E402
from meshrun.models.from_config import model_args_from_config  # noqa: E402
from meshrun.models.llama import Transformer  # noqa: E402
from meshrun.rundir.runs import FINAL_WEIGHTS, write_finished  # noqa: E402
from meshrun.trained.generate import Sampler, generate_ids, generate_text, load  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SETS = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=64"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("gen") / "tiny"
    run.mkdir()
    cfg = load_config(None, SETS)
    save_config(cfg, run / "config.toml")
    model = Transformer(model_args_from_config(cfg.model, 259), seed=11)
    torch.save(model.state_dict(), run / FINAL_WEIGHTS)
    write_finished(run, 1)
    return run


def test_same_seed_same_text_and_seeds_differ(run_dir: Path):
    loaded = load(run_dir)
    one = generate_text(loaded, "The ", Sampler(max_new_tokens=40, temperature=1.0, seed=3))
    assert one.startswith("The ") and len(one) > len("The ")
    assert generate_text(loaded, "The ", Sampler(max_new_tokens=40, temperature=1.0, seed=3)) == one
    others = {generate_text(loaded, "The ", Sampler(max_new_tokens=40, temperature=1.0, seed=s)) for s in (4, 5)}
    assert one not in others  # 40 draws from ~259 near-uniform tokens: a collision is ~impossible


def test_greedy_with_kv_cache_equals_full_recompute(run_dir: Path):
    loaded = load(run_dir)
    prompt = loaded.tokenizer.encode("hello")
    ids = generate_ids(loaded, prompt, Sampler(max_new_tokens=12, temperature=0))
    assert ids == generate_ids(loaded, prompt, Sampler(max_new_tokens=12, temperature=0, seed=99))
    ours = Transformer(model_args_from_config(load_config(None, SETS).model, 259), seed=11).eval()
    seq = list(prompt)
    with torch.no_grad():  # the built-in model, no cache: the whole sequence each step
        for _ in range(len(ids)):
            seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
    assert seq[len(prompt):] == ids


def test_hf_directory_gives_the_same_text(run_dir: Path, tmp_path: Path):
    from meshrun.trained.export_hf import export_hf

    export_hf(run_dir, tmp_path / "hf")
    sampler = Sampler(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=1)
    assert generate_text(load(tmp_path / "hf"), "ab", sampler) == generate_text(load(run_dir), "ab", sampler)


def test_bad_input_is_one_line_exit_2(tmp_path: Path, monkeypatch):
    (tmp_path / "empty").mkdir()
    for args, words in ((["generate", str(tmp_path / "missing")], "does not exist"),
                        (["generate", str(tmp_path), "--top-p", "0"], "--top-p"),
                        (["generate", str(tmp_path), "--max-new-tokens", "x"], "--max-new-tokens")):
        result = meshrun(*args, env=ENV, timeout=60)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and words in lines[0], (args, result.output)
    from meshrun.errors import ConfigError

    with pytest.raises(ConfigError, match="is neither a meshrun run directory"):
        load(tmp_path / "empty")
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # as if not installed

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"pip install 'meshrun\[hf\]'"):
        load(tmp_path / "hf")


def test_a_model_hf_run_generates_and_exports_as_its_hf_model(tmp_path: Path):
    """A `[model] hf = DIR` run (tensors under the adapter's names, as hfin's trainer saves them) samples
    the tokens transformers' own generate gives, and exports back to DIR's config with equal logits."""
    import transformers

    from meshrun.models.hf_keys import from_hf_key
    from meshrun.trained.export_hf import export_hf

    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, bos_token_id=257, eos_token_id=256)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path / "base")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(f'[model]\nhf = "{tmp_path / "base"}"\n\n[data]\ntokenizer = "byte"\n')
    torch.save({from_hf_key(k): v for k, v in ref.state_dict().items()}, run / FINAL_WEIGHTS)
    write_finished(run, 1)
    prompt = [72, 105]
    ours = generate_ids(load(run), prompt, Sampler(max_new_tokens=10, temperature=0))
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 2:].tolist()
    assert ours == (theirs[:theirs.index(256)] if 256 in theirs else theirs)
    export_hf(run, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_text() == (tmp_path / "base" / "config.json").read_text()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    tokens = torch.randint(0, 259, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, ref(tokens).logits)
