"""A trained run's tensors as a Hugging Face Llama-family model: names, RoPE permutation, config.json.

Two kinds of run:
- the built-in decoder (meshrun.models.llama): `_BLOCK` below renames what sits inside a block
  (`attention.wq` -> `self_attn.q_proj`, ...) to the names meshrun's HF adapter uses, and
  models/hf_keys.py's `to_hf_key` adds HF's top-level prefixes (`model.layers.N.`, `lm_head.`).
  The built-in RoPE rotates consecutive pairs (x[2i], x[2i+1]), as Meta's complex-number
  reference does; HF's Llama rotates halves (x[i], x[i + d/2]). So the rows of wq and wk are
  permuted within each head, exactly as transformers' convert_llama_weights_to_hf does.
- a `[model] hf = "DIR"` run: its tensors already carry the adapter's names, so `to_hf_key` alone
  maps them, and config.json is the one in DIR.

`HFPlan` says, for each meshrun tensor, its HF name (None: not written) and how to convert it;
`ckpt export --format hf` and `meshrun generate` both use it. No transformers import here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from meshrun.errors import ConfigError
from meshrun.models.args import ModelArgs
from meshrun.models.hf_keys import to_hf_key

# inside `layers.N.`: built-in name -> the HF adapter's (= HF's) name
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = ("tok_embeddings.weight", "norm.weight", "output.weight")  # the same names in the adapter


def builtin_to_adapter(name: str) -> str:
    """`layers.3.attention.wq.weight` -> `layers.3.self_attn.q_proj.weight`; top-level names stay."""
    if name in _TOP:
        return name
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _BLOCK:
        return f"layers.{parts[1]}.{_BLOCK[parts[2]]}"
    raise ConfigError(f"the tensor {name!r} is not a tensor of the built-in model; export --format hf "
                      "handles the built-in decoder and [model] hf runs only")


def rope_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from interleaved RoPE pairs to HF's halves, head by head."""
    out_dim, in_dim = weight.shape
    return weight.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


@dataclass
class HFPlan:
    """How one run's tensors become an HF checkpoint: names, conversions and config.json."""

    config: dict
    """config.json, as written."""
    names: dict[str, str]
    """meshrun tensor name -> HF tensor name, for every tensor written (in writing order)."""
    rope_heads: dict[str, int]
    """meshrun tensor name -> heads, for the q/k projections whose rows are permuted."""

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = self.rope_heads.get(name)
        return rope_permute(tensor, heads) if heads else tensor.contiguous()


def builtin_plan(specs: dict[str, tuple], run_config: dict, tokenizer_ids: dict) -> HFPlan:
    """The plan for a run of the built-in decoder, its LlamaConfig built from the run's ModelArgs."""
    from meshrun.config.loader import config_from_dict
    from meshrun.models.from_config import model_args_from_config

    model_cfg = config_from_dict(run_config).model
    if getattr(model_cfg, "factory", ""):
        raise ConfigError(f"model.factory={model_cfg.factory!r}: export --format hf handles the built-in "
                          "decoder and [model] hf runs, not a custom model; use --format safetensors")
    vocab = specs.get("tok_embeddings.weight", specs.get("output.weight", ((0,), None)))[0][0]
    args = model_args_from_config(model_cfg, vocab or None)
    if args.experts:
        raise ConfigError(f"model.experts={args.experts}: the built-in mixture of experts has no Hugging Face "
                          "layout yet, which `meshrun ckpt export --format hf` and `meshrun generate` need; "
                          "export its weights with --format safetensors")
    names = {name: to_hf_key(builtin_to_adapter(name)) for name in specs
             if not (args.tie_embeddings and name == "output.weight")}
    want = {to_hf_key(builtin_to_adapter(n)) for n in builtin_names(args)}
    if set(names.values()) != want:
        missing = sorted(want - set(names.values()))[:3]
        raise ConfigError(f"the checkpoint's tensors do not fit its config's model (missing {missing}); "
                          "was the run's config.toml changed after training?")
    rope = {}
    for name in specs:
        if name.endswith("attention.wq.weight"):
            rope[name] = args.n_heads
        elif name.endswith("attention.wk.weight"):
            rope[name] = args.n_kv_heads
    config = llama_config(args, tokenizer_ids)
    config["dtype"] = str(specs[next(iter(names))][1]).replace("torch.", "")
    return HFPlan(config, names, rope)


def builtin_names(args: ModelArgs) -> list[str]:
    """Every tensor name of the built-in decoder with these args (tied: no output.weight)."""
    names = ["tok_embeddings.weight"]
    for i in range(args.n_layers):
        names += [f"layers.{i}.{suffix}" for suffix in _BLOCK]
    names.append("norm.weight")
    if not args.tie_embeddings:
        names.append("output.weight")
    return names


def llama_config(args: ModelArgs, tokenizer_ids: dict) -> dict:
    """config.json of the LlamaForCausalLM that computes what the built-in decoder computes."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(args.rope_theta)},
        "rope_theta": float(args.rope_theta),  # transformers 4.x reads this; 5.x reads rope_parameters
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "float32",
        **{f"{k}_token_id": v for k, v in tokenizer_ids.items()},
    }


def hf_run_plan(specs: dict[str, tuple], hf_dir: str, tie_embeddings: bool | None = None) -> HFPlan:
    """The plan for a `[model] hf = DIR` run: adapter names -> the names of transformers' modules
    (where the adapter's pieces sit: `HFParts.prefixes` from a build on meta), config.json as DIR has
    it (with `tie_word_embeddings` false when model.tie_embeddings=false untied the head). The
    module names are what transformers' from_pretrained loads as they are (a mixture of experts'
    fused expert tensors included)."""
    from meshrun.models.hf import hf_parts

    path = Path(hf_dir).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.hf={hf_dir!r}: cannot read {path} ({type(exc).__name__}); the run's "
                          "Hugging Face model directory must still be there to export it") from None
    tied = bool(config.get("tie_word_embeddings", False))
    if tied and tie_embeddings is False:
        config["tie_word_embeddings"] = tied = False
    prefixes = hf_parts(hf_dir, tie_embeddings).prefixes
    names = {}
    for name in specs:
        if name.split(".", 1)[0] in ("extras", "rotary_emb"):
            continue  # buffer-only modules (rotary tables): derived, never in an HF checkpoint
        try:
            hf_name = to_hf_key(name, prefixes)
        except KeyError:
            raise ConfigError(f"model.hf={hf_dir!r}: the checkpoint's tensor {name!r} is not a name of meshrun's "
                              "Hugging Face adapter; was this run trained with [model] hf?") from None
        if not (tied and name == "output.weight"):
            names[name] = hf_name
    return HFPlan(config, names, {})


def plan_for(specs: dict[str, tuple], run_config: dict, tokenizer_ids: dict) -> HFPlan:
    """The plan for a run of either kind, chosen by its `[model] hf`."""
    hf_dir = str(run_config.get("model", {}).get("hf", "") or "")
    if hf_dir:
        return hf_run_plan(specs, hf_dir, run_config.get("model", {}).get("tie_embeddings"))
    return builtin_plan(specs, run_config, tokenizer_ids)
