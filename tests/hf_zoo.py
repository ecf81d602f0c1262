"""A zoo of tiny random Hugging Face causal LMs, built from configs only (nothing is downloaded).

Every model has hidden size 32, 2 decoder layers (a 2-stage pipeline splits them 1+1), 4 attention
heads of head_dim 8 (2 key/value heads where the architecture has GQA), MLP intermediate 64 (MoE
expert intermediate 32), vocab 300, 64 positions, every dropout 0.0 and use_cache False.
pad_token_id is None everywhere (so no embedding has a padding_idx row with a frozen gradient) and
bos/eos ids lie inside the vocabulary.

What each architecture exercises:

- llama:     the baseline: RMSNorm, RoPE, GQA (4 q / 2 kv heads), SwiGLU, untied lm_head.
- mistral:   llama plus sliding-window attention (window 8, so it masks at sequence length 16).
- qwen2:     biases on q/k/v projections (o_proj without), tied input/output embeddings.
- qwen3:     per-head RMSNorm on q and k (q_norm/k_norm, weight of size head_dim=8), tied embeddings.
- gemma3:    Gemma3TextConfig (model_type gemma3_text): embeddings scaled by sqrt(hidden), layer 0
             sliding (window 8, local RoPE theta) and layer 1 full (global RoPE theta), 4 norms per
             layer, (1 + weight) RMSNorm, q/k norms, GELU-tanh, tied embeddings.
- phi3:      fused qkv_proj and fused gate_up_proj (TP plans must split fused weights), residual dropouts.
- gpt_neox:  partial rotary (half of head_dim), parallel residual, LayerNorm with bias, fused
             query_key_value (per-head interleaved q,k,v) with bias, no GQA, untied output head (the
             module is `lm_head`, saved on disk as `embed_out.weight`), base model under `gpt_neox`.
- gpt2:      Conv1D (weights stored transposed, in x out), learned position embeddings wpe, fused
             c_attn, LayerNorm with bias, tied lm_head, base model under `transformer`, attribute `h`.
- olmo2:     post-norm (norm after attention / MLP, before the residual add) and QK norm over the
             whole projection (not per head), untied.
- mixtral:   sparse MoE: 4 local experts, top-2 routing, every layer sparse, expert intermediate 32.
- opt:       the base model one level down (`model.decoder`), learned positions with an offset, the
             final norm registered before the layers (which run first is seen in a meta forward),
             no base_model_tp_plan, tied head.
- qwen2_moe: sparse MoE: 4 experts, top-2 (norm_topk_prob False), a sigmoid-gated shared expert
             (intermediate 64), every layer sparse (decoder_sparse_step=1, mlp_only_layers=[]).

save_pretrained writes the original on-disk layout (save_original_format=True): Mixtral experts as
`block_sparse_moe.experts.{i}.w1/w2/w3`, Qwen2-MoE experts as `mlp.experts.{i}.gate_proj/up_proj/down_proj`,
GPT-NeoX's head as `embed_out`; from_pretrained converts them back to the fused in-memory tensors.

For the MoE models output_router_logits stays False (the default), so `loss` is the plain LM loss.
If it were True, the CausalLM forward would add router_aux_loss_coef (0.001) times the
load-balancing loss over all layers' router logits to the loss it returns (the logits are unchanged);
reference_losses below ignores `loss` and computes its own cross-entropy from the logits anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN = 32
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
INTERMEDIATE = 64
EXPERT_INTERMEDIATE = 32
VOCAB = 300
POSITIONS = 64
SLIDING_WINDOW = 8

# Keys every decoder-only config takes with the same meaning.
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    intermediate_size=INTERMEDIATE,
    max_position_embeddings=POSITIONS,
    attention_dropout=0.0,
    use_cache=False,
    pad_token_id=None,
    bos_token_id=1,
    eos_token_id=2,
)


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(
        **_COMMON, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, tie_word_embeddings=False
    )


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(
        **_COMMON,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=SLIDING_WINDOW,
        tie_word_embeddings=False,
    )


def _qwen2():
    from transformers import Qwen2Config

    # Qwen2 has no head_dim / attention_bias keys: head_dim = hidden / heads = 8, q/k/v always have a bias.
    return Qwen2Config(
        **_COMMON, num_key_value_heads=KV_HEADS, use_sliding_window=False, tie_word_embeddings=True
    )


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(
        **_COMMON,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        attention_bias=False,
        use_sliding_window=False,
        tie_word_embeddings=True,
    )


def _gemma3():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_COMMON,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,  # attention scale 1/sqrt(head_dim), as real configs have
        sliding_window=SLIDING_WINDOW,
        # what sliding_window_pattern=2 would give: layer 0 sliding, layer 1 full
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True,
    )


def _phi3():
    from transformers import Phi3Config

    return Phi3Config(
        **_COMMON,
        num_key_value_heads=KV_HEADS,
        original_max_position_embeddings=POSITIONS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        sliding_window=None,
        tie_word_embeddings=False,
    )


def _gpt_neox():
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        **_COMMON,
        hidden_dropout=0.0,
        classifier_dropout=0.0,
        use_parallel_residual=True,
        attention_bias=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        tie_word_embeddings=False,
    )


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=INTERMEDIATE,
        n_positions=POSITIONS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        use_cache=False,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )


def _olmo2():
    from transformers import Olmo2Config

    return Olmo2Config(
        **_COMMON, num_key_value_heads=KV_HEADS, attention_bias=False, tie_word_embeddings=False
    )


def _mixtral():
    from transformers import MixtralConfig

    # Mixtral's intermediate_size is the per-expert size
    common = dict(_COMMON, intermediate_size=EXPERT_INTERMEDIATE)
    return MixtralConfig(
        **common,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        output_router_logits=False,
        sliding_window=None,
        tie_word_embeddings=False,
    )


def _opt():
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        ffn_dim=INTERMEDIATE, max_position_embeddings=POSITIONS, word_embed_proj_dim=HIDDEN,
        dropout=0.0, attention_dropout=0.0, layerdrop=0.0, use_cache=False, pad_token_id=None,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )


def _qwen2_moe():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **_COMMON,
        num_key_value_heads=KV_HEADS,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=EXPERT_INTERMEDIATE,
        shared_expert_intermediate_size=INTERMEDIATE,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        use_sliding_window=False,
        tie_word_embeddings=False,
    )


ARCHS: dict[str, Callable[[], object]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "gpt_neox": _gpt_neox,
    "gpt2": _gpt2,
    "olmo2": _olmo2,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "opt": _opt,
}


def save_tiny(path, arch: str, *, seed: int = 0) -> Path:
    """Build `arch` with random weights (torch.manual_seed(seed)) and save it to `path` with
    save_pretrained (config.json, generation_config.json, model.safetensors); returns the path."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(ARCHS[arch](), dtype=torch.float32)
    model.save_pretrained(path)  # transformers 5 always writes safetensors
    return path


def reference_losses(path, tokens: torch.Tensor, steps: int, lr: float, *, untie: bool = False) -> list[float]:
    """Train the saved model in one process with plain transformers: AdamW(lr, weight_decay 0), next-token
    cross-entropy of model(tokens[:, :-1]).logits against tokens[:, 1:]; returns the loss of each step.
    `untie`: the head made its own copy of the embedding first (what model.tie_embeddings=false does)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if untie:
        model.config.tie_word_embeddings = False
        model.get_output_embeddings().weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
