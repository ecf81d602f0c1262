"""model.hf before torch: the directory's shape as ModelArgs, and the one-line refusals."""

from __future__ import annotations

import json

import pytest

from meshrun.config import load_config
from meshrun.errors import ConfigError
from meshrun.models.from_config import model_args_from_config
from meshrun.models.hf_config import model_args_from_hf
from meshrun.train.preflight import check_before_torch

QWEN3 = {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 64,
         "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
         "rms_norm_eps": 1e-6}


def _hf_dir(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def test_the_shape_comes_from_config_json(tmp_path):
    path = str(_hf_dir(tmp_path, QWEN3))
    args = model_args_from_hf(path, vocab_size=259)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_hidden) == (32, 3, 4, 2, 64)
    assert (args.vocab_size, args.max_seq_len, args.tie_embeddings, args.rope_theta) == (300, 64, True, 5e5)
    # the planner and the pre-flight read the same through the [model] section
    assert model_args_from_config(load_config(None, [f"model.hf={path}", "data.seq_len=64"]).model, 259) == args


def test_a_tokenizer_larger_than_the_model_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"data.tokenizer has 301 ids but model.hf=.* has vocab_size=300"):
        model_args_from_hf(str(_hf_dir(tmp_path, QWEN3)), vocab_size=301)


@pytest.mark.parametrize("override, message", [
    ("model.init_from=w.pt", "model.init_from"),
    ("model.n_layers=4", "model.n_layers=4 cannot change the shape"),
    ("model.tie_embeddings=true", "model.tie_embeddings=True"),
])
def test_keys_that_contradict_the_directory_are_refused(tmp_path, override, message):
    path = _hf_dir(tmp_path, QWEN3)
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"model.hf={path}", override])


def _before_torch(tmp_path, *overrides: str) -> None:
    check_before_torch(load_config(None, [*overrides, f"train.run_dir={tmp_path / 'runs'}"]), nproc_per_node="2")


def test_the_directory_is_read_before_launch_and_any_model_type_passes_it(tmp_path):
    """The directory is read before launch (train/preflight.py), not while the config loads; there is
    no list of families: whether transformers builds the model_type is the build's to say
    (tests/e2e/test_hf_train.py refuses an unknown one in one line)."""
    path = _hf_dir(tmp_path, {**QWEN3, "model_type": "mixtral"})
    load_config(None, [f"model.hf={path}"])  # the section reads no file
    _before_torch(tmp_path, f"model.hf={path}", "data.seq_len=32")
    with pytest.raises(ConfigError, match=r"data.seq_len=65 is longer than model.hf=.* \(max_position_embeddings=64\)"):
        _before_torch(tmp_path, f"model.hf={path}", "data.seq_len=65")
    (path / "config.json").write_text(json.dumps({**QWEN3, "model_type": None}))
    with pytest.raises(ConfigError, match="has no model_type"):
        _before_torch(tmp_path, f"model.hf={path}")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        _before_torch(tmp_path, f"model.hf={path}")


def test_tensor_parallel_rules_of_an_hf_model_are_checked_before_launch(tmp_path):
    from conftest import save_tiny_hf

    from meshrun.train.preflight import check_with_torch

    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_proj": "packed_colwise"}
    path = save_tiny_hf(tmp_path / "qwen3", "qwen3")  # real weights: the checks read their headers too
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, "base_model_tp_plan": plan}))
    tp2 = [f"model.hf={path}", "data.seq_len=32", "parallel.strategy=fsdp", "parallel.dp_replicate=1", "parallel.tp=2"]
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel=true is not offered for model.hf="):
        check_with_torch(load_config(None, [*tp2, "parallel.sequence_parallel=true"]), nproc_per_node="2")
    with pytest.raises(ConfigError, match=r"parallel.tp=2: .*\{'mlp.gate_proj': 'packed_colwise'\} are not supported.*"
                                          r"set parallel.tp=1 and shard with parallel.dp_shard"):
        check_with_torch(load_config(None, tp2), nproc_per_node="2")
    check_with_torch(load_config(None, tp2[:2]), nproc_per_node="2")  # DDP: the TP plan is not read
    (path / "config.json").write_text(json.dumps(saved))  # the plan left to the transformers class
    check_with_torch(load_config(None, tp2), nproc_per_node="2")  # the workers check the built config's
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel=true is not offered"):
        check_with_torch(load_config(None, [*tp2, "parallel.sequence_parallel=true"]), nproc_per_node="2")


def test_a_name_too_long_for_the_filesystem_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"model.hf='x{80}'\.\.\. is not a usable path \(File name too long\)"):
        _before_torch(tmp_path, "model.hf=" + "x" * 300)


def test_an_encoder_decoder_is_refused_as_one_before_its_shape_is_read(tmp_path):
    """Bart's config has no decoder-only shape keys: the refusal names what it is, not a missing key."""
    pytest.importorskip("transformers")
    from transformers import BartConfig, BartForConditionalGeneration

    from meshrun.errors import ModelError
    from meshrun.models.hf import build_hf_model
    from meshrun.models.meta import on_meta

    config = BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=300,
                        max_position_embeddings=64)
    BartForConditionalGeneration(config).save_pretrained(tmp_path / "bart")
    with pytest.raises(ModelError, match=r"model_type 'bart' is an encoder-decoder; meshrun trains decoder-only"):
        with on_meta():
            build_hf_model(str(tmp_path / "bart"))


def test_pipeline_is_refused_when_the_order_of_the_input_parts_cannot_be_seen(tmp_path, monkeypatch):
    """GPT-2 registers wpe before its layers; which runs first is read from a forward on meta. When
    that forward cannot run (here: made to fail), a pipeline split would guess, so PP is refused."""
    pytest.importorskip("transformers")
    import hf_zoo

    from meshrun.models import hf_parts
    from meshrun.models.hf import build_hf_model
    from meshrun.models.meta import on_meta

    path = str(hf_zoo.save_tiny(tmp_path / "gpt2", "gpt2"))
    with on_meta():
        assert build_hf_model(path).parts.input_parts == ("wpe",)  # seen running before the layers
        monkeypatch.setattr(hf_parts, "_run_order", lambda *a: None)
        model = build_hf_model(path)
    assert model.parts.unordered == ("wpe",)
    model.check_layout(tp=1, pp=1)  # nothing to guess without a split
    with pytest.raises(ConfigError, match=r"parallel.pp=2: model.hf=.* registers wpe before its decoder layers.*"
                                          r"set parallel.pp=1 and shard with parallel.dp_shard"):
        model.check_layout(tp=1, pp=2)


@pytest.mark.parametrize(("key", "experts"), [("num_local_experts", 8), ("num_experts", 4), ("n_routed_experts", 64),
                                               (None, 0)])
def test_expert_parallel_of_an_hf_model_reads_its_routed_experts_before_launch(tmp_path, key, experts):
    """Mixtral's, Qwen-MoE's and DeepSeek's count of routed experts: ep must divide it, and a dense
    model has none to split; the same rule the built-in model's experts get."""
    from meshrun.models.from_config import model_shape_from_config
    from meshrun.models.hf_config import hf_routed_experts
    from meshrun.train.preflight import _check_layout

    def check_layout_before_launch(cfg, world: int) -> None:  # the pre-launch layout check, as train runs it
        _check_layout(cfg, 259, str(world), "1")

    path = str(_hf_dir(tmp_path, {**QWEN3, **({key: experts} if key else {})}))
    assert hf_routed_experts(path) == experts
    base = [f"model.hf={path}", "data.seq_len=64", "parallel.strategy=fsdp"]
    cfg = load_config(None, base)
    assert model_shape_from_config(cfg.model, model_args_from_config(cfg.model, 259)).experts == experts
    if experts:
        check_layout_before_launch(load_config(None, [*base, "parallel.ep=2"]), world=2)
        with pytest.raises(ConfigError, match=rf"model.experts={experts} is not divisible by parallel.ep=3"):
            check_layout_before_launch(load_config(None, [*base, "parallel.ep=3"]), world=3)
    else:
        with pytest.raises(ConfigError, match=r"parallel.ep=2 splits routed experts, but the model has none"):
            check_layout_before_launch(load_config(None, [*base, "parallel.ep=2"]), world=2)
