"""`[model] hf = "DIR"` before torch: the directory's checks and its shape.

A Hugging Face model directory holds `config.json` and `*.safetensors` (one file, or shards with
`model.safetensors.index.json`). Config validation and `meshrun plan` read it here, without
torch or transformers, so a wrong directory is one line and exit 2 before any process starts
(train/preflight.py). Whether transformers can build the architecture, and what its structure
allows under the layout, is the adapter's to say (models/hf.py, also before launch). Pure Python. The [model] keys that contradict
model.hf are refused by the section itself (config/sections.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshrun.errors import ConfigError, shown
from meshrun.models.args import ModelArgs
from meshrun.runtime.inputs import read_json

CONFIG_FILE = "config.json"

# config.json keys of the model's shape, each with the other names architectures give it (GPT-2:
# n_embd, n_layer, n_head, n_positions, n_inner): (meshrun's key, names, required).
SHAPE_KEYS = (("vocab_size", ("vocab_size",), True),
              ("hidden_size", ("hidden_size", "n_embd", "d_model"), True),
              # not required here: NemotronH's config.json has none (transformers derives it from
              # layers_block_type); model_args_from_hf asks the transformers config
              ("num_hidden_layers", ("num_hidden_layers", "n_layer", "num_layers", "n_layers"), False),
              # not required: attention-free models (Mamba, RWKV, xLSTM) have none
              ("num_attention_heads", ("num_attention_heads", "n_head", "n_heads", "attention_heads"), False),
              ("num_key_value_heads", ("num_key_value_heads",), False),
              ("intermediate_size", ("intermediate_size", "n_inner", "ffn_dim"), False),
              ("max_position_embeddings", ("max_position_embeddings", "n_positions", "n_ctx"), False),
              ("head_dim", ("head_dim",), False))


def shape_value(config: dict[str, Any], key: str) -> Any:
    """config.json's value of the shape key `key` under any of its names (SHAPE_KEYS), or None."""
    names = next((names for k, names, _ in SHAPE_KEYS if k == key), (key,))
    return next((config[n] for n in names if config.get(n) is not None), None)


def read_hf_config(path: str) -> dict[str, Any]:
    """config.json of the HF directory `path`, checked: a directory, readable JSON, a supported
    `model_type`, and safetensors weights. One ConfigError naming model.hf otherwise."""
    where = f"model.hf={path!r}"
    root = Path(path).expanduser()
    try:
        is_dir = root.is_dir()
    except OSError as exc:  # a name too long for the filesystem, a path it cannot search...
        raise ConfigError(f"model.hf={shown(path)} is not a usable path "
                          f"({exc.strerror}); give a local directory with config.json and *.safetensors") from None
    if not is_dir:
        raise ConfigError(f"{where} is not a directory; give a local directory with config.json and "
                          "*.safetensors (e.g. from save_pretrained)")
    config = read_json("model.hf", root / CONFIG_FILE, fix="give the directory save_pretrained wrote")
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: {CONFIG_FILE} holds {type(config).__name__}, not a JSON object")
    kind = config.get("model_type")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"{where}: {CONFIG_FILE} has no model_type; give the directory save_pretrained wrote")
    if not any(root.glob("*.safetensors")):
        raise ConfigError(f"{where} has no *.safetensors weights; save the model with "
                          "save_pretrained(DIR) (safe_serialization, the default)")
    _check_shape_keys(config, where)
    return config


SHAPE_FLOATS = ("rope_theta", "rms_norm_eps")


def _check_shape_keys(config: dict[str, Any], where: str) -> None:
    """The keys the shape is read from hold what transformers writes there: one line otherwise."""
    fix = "fix config.json or save the model again with save_pretrained"
    for key, _names, required in SHAPE_KEYS:
        value = shape_value(config, key)
        if value is None and not required:
            continue
        if value is None:
            raise ConfigError(f"{where}: {CONFIG_FILE} has no {key!r}; {fix}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {CONFIG_FILE} {key}={json.dumps(value)[:60]} is not a positive integer; {fix}")
    for key in SHAPE_FLOATS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ConfigError(f"{where}: {CONFIG_FILE} {key}={json.dumps(value)[:60]} is not a number >= 0; {fix}")
    rope = config.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ConfigError(f"{where}: {CONFIG_FILE} rope_parameters={json.dumps(rope)[:60]} is not an object; {fix}")
    theta = (rope or {}).get("rope_theta")
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0):
        raise ConfigError(f"{where}: {CONFIG_FILE} rope_parameters.rope_theta={json.dumps(theta)[:60]} "
                          f"is not a positive number; {fix}")
    tie = config.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):
        raise ConfigError(f"{where}: {CONFIG_FILE} tie_word_embeddings={json.dumps(tie)[:60]} is not true or false; {fix}")


# config.json's count of routed experts, by architecture (Mixtral; Qwen2/3-MoE, OLMoE; DeepSeek).
ROUTED_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def hf_routed_experts(path: str) -> int:
    """The routed experts of the HF model in `path` (0 for a dense one): what expert parallel splits."""
    c = read_hf_config(path)
    text = c.get("text_config") if isinstance(c.get("text_config"), dict) else c
    for key in ROUTED_EXPERTS_KEYS:
        value = text.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def model_args_from_hf(path: str, vocab_size: int | None = None, hf_config: Any = None) -> ModelArgs:
    """The built-in `ModelArgs` with the HF model's shape: what the layout rules, `meshrun plan`
    and the FLOPs count read. `vocab_size` is the tokenizer's: it must fit the model's. Given
    `hf_config` (the transformers config object: its attribute_map and derived properties know
    every architecture's names), the shape keys are read from it."""
    c = read_hf_config(path)
    if hf_config is not None:
        text = hf_config.get_text_config()
        for key, _names, _required in SHAPE_KEYS:
            value = getattr(text, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                c = {**c, key: value}
    if shape_value(c, "num_hidden_layers") is None:
        raise ConfigError(f"model.hf={path!r}: {CONFIG_FILE} has no 'num_hidden_layers'; fix config.json or "
                          "save the model again with save_pretrained")
    heads = int(shape_value(c, "num_attention_heads") or 1)
    model_vocab = int(c["vocab_size"])
    hidden = int(shape_value(c, "hidden_size"))
    if vocab_size and vocab_size > model_vocab:
        raise ConfigError(f"data.tokenizer has {vocab_size} ids but model.hf={path!r} has vocab_size="
                          f"{model_vocab}; use the model's own tokenizer (or one with at most {model_vocab} ids)")
    rope = c.get("rope_parameters") or {}
    return ModelArgs(
        vocab_size=model_vocab,
        dim=hidden,
        n_layers=int(shape_value(c, "num_hidden_layers")),
        n_heads=heads,
        n_kv_heads=int(shape_value(c, "num_key_value_heads") or heads),
        ffn_hidden=int(shape_value(c, "intermediate_size") or 4 * hidden),
        max_seq_len=int(shape_value(c, "max_position_embeddings") or 2048),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0),
        norm_eps=float(c.get("rms_norm_eps") or 1e-6),
    )


# base_model_tp_plan styles meshrun maps onto torch's parallel styles (models/hf.py builds them).
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
             "replicated_with_grad_allreduce")


def layer_tp_plan(config: Any) -> dict[str, str]:
    """The decoder layer's entries of a config's `base_model_tp_plan`, `layers.*.` cut off
    (`config` is a transformers config object or config.json's dict)."""
    plan = (config.get("base_model_tp_plan") if isinstance(config, dict)
            else getattr(config, "base_model_tp_plan", None)) or {}
    return {k.removeprefix("layers.*."): v for k, v in plan.items() if k.startswith("layers.*.")}


def context_parallel_refusal(config: dict[str, Any]) -> str:
    """Why parallel.cp cannot split this architecture's attention ("" when it can), from config.json.

    Context parallel runs causal attention over the whole sequence as a ring; a window, a
    soft cap on the logits, attention dropout or a bidirectional model changes what each token
    sees, and the ring would compute something else.
    """
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    kinds = text.get("layer_types")
    if isinstance(kinds, list) and any(kind != "full_attention" for kind in kinds):
        other = sorted({str(kind) for kind in kinds if kind != "full_attention"})
        return f"layer_types has {', '.join(other)[:60]} layers (only full causal attention is split)"
    if text.get("sliding_window") not in (None, 0) and text.get("use_sliding_window", True) is not False:
        return f"sliding_window={text.get('sliding_window')} (only full causal attention is split)"
    for key in ("attn_logit_softcapping", "attention_softcap"):
        if text.get(key) not in (None, 0):
            return f"{key}={text.get(key)} (the ring computes plain softmax attention)"
    dropout = text.get("attention_dropout")
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout > 0:
        return f"attention_dropout={dropout} (the ring runs without dropout)"
    if text.get("is_causal") is False:
        return "is_causal=false (the ring splits causal attention)"
    return ""


def check_hf_context_parallel(path: str, cp: int) -> None:
    """parallel.cp > 1 with model.hf: the architecture's attention is one the ring computes
    (the rule and its line: meshrun.parallel.rules.check_cp_attention)."""
    from meshrun.parallel.rules import check_cp_attention

    if cp > 1:
        check_cp_attention(cp, path, context_parallel_refusal(read_hf_config(path)))


def check_hf_seq_len(path: str, seq_len: int) -> None:
    """data.seq_len within the model's max_position_embeddings (its RoPE tables and masks end there)."""
    limit = shape_value(read_hf_config(path), "max_position_embeddings")
    if limit and seq_len > int(limit):
        raise ConfigError(f"data.seq_len={seq_len} is longer than model.hf={path!r} allows "
                          f"(max_position_embeddings={int(limit)}); set data.seq_len to {int(limit)} or less")
