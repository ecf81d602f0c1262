"""A Hugging Face causal LM (Llama family) seen through meshrun's model protocol.

    model = build_hf_model("path/to/hf_dir", vocab_size=tokenizer.vocab_size)   # under torch.device("meta")

`transformers` builds the model from the directory's config.json; this adapter keeps its modules
unchanged and lays them out under the names meshrun's layouts address (`models.factory.
ModelProtocol`): `tok_embeddings` (HF `model.embed_tokens`), `layers` (an `nn.ModuleDict` "0".."N-1"
of the HF decoder layers), `norm` (`model.norm`), `output` (`lm_head`), `rotary_emb`
(`model.rotary_emb`). Below a decoder layer every name is HF's (`self_attn.q_proj`, `mlp.gate_proj`),
so `models.hf_keys` maps a state dict both ways. `forward(tokens)` does what HF's `LlamaModel.
forward` does around the layers (positions, rotary cos/sin, causal mask), and skips whatever a
pipeline stage set to None. The weights come from the directory's safetensors
(`meshrun.models.hf_load`), straight into each rank's shards.
"""

from __future__ import annotations

import sys
import zlib
from typing import Any

import torch
from torch import nn

from meshrun.errors import ModelError
from meshrun.extras import missing_extra_message
from meshrun.models.hf_config import TP_STYLES, layer_tp_plan, model_args_from_hf

# transformers' TP style names (config.base_model_tp_plan) -> how meshrun applies each.


def build_hf_model(path: str, vocab_size: int | None = None, *, seed: int | None = None) -> HFCausalLM:
    """The adapter over the HF model of directory `path`, built on the ambient device.

    On the meta device it holds shapes only (the layout materialises and loads this rank's
    share); on a real device the directory's weights are loaded into it (one process).
    """
    args = model_args_from_hf(path, vocab_size)  # checks the directory and the vocabulary
    model = HFCausalLM(path, args)
    model.weights_pending = True  # materialise cheaply: the directory's weights come next
    if not any(p.is_meta for p in model.parameters()):
        from meshrun.models.hf_load import load_hf_weights

        model.init_weights(seed)  # the rotary tables
        load_hf_weights([model], path)
    return model


def _hf_config(path: str) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ModelError(missing_extra_message("transformers", "model.hf")) from None
    return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)


class HFCausalLM(nn.Module):
    """`model(tokens) -> logits` (B, T, vocab) over a transformers Llama-family causal LM.

    `args` is the built-in `ModelArgs` with this model's shape (what the layout rules, the
    planner and the FLOPs count read); `config` is the transformers config; `hf_dir` the source.
    A pipeline stage deletes blocks from `layers` and sets `tok_embeddings` / `norm` / `output`
    to None: without `tok_embeddings` the input is hidden states (B, T, hidden_size), without
    `output` the result is.
    """

    def __init__(self, path: str, args: Any):
        super().__init__()
        from transformers import AutoModelForCausalLM

        config = _hf_config(path)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # fp32 master weights
        self.hf_dir, self.args, self.config = path, args, hf.config
        base = hf.model
        self.tok_embeddings: nn.Module | None = base.embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(base.layers)})
        self.norm: nn.Module | None = base.norm
        self.output: nn.Module | None = hf.lm_head  # the embedding's own Parameter when tied
        self.rotary_emb = base.rotary_emb
        self.weights_pending = False
        """True until `load_hf_weights` filled the parameters: `init_weights` then only zeroes them
        (no full-size random tensors drawn, which would cost memory, for values about to be replaced)."""
        kinds = getattr(self.config, "layer_types", None)
        sliding = "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"
        self._mask_kind = {str(i): kinds[i] if kinds else sliding for i in range(len(base.layers))}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seqlen = h.shape[1]
        if seqlen > self.args.max_seq_len:
            raise ModelError(f"sequence length {seqlen} exceeds the max_position_embeddings="
                             f"{self.args.max_seq_len} of model.hf={self.hf_dir!r}; lower data.seq_len")
        position_ids = torch.arange(seqlen, device=h.device).unsqueeze(0)
        mask_args = dict(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                         position_ids=position_ids)
        masks = {}
        for kind in set(self._mask_kind[key] for key in self.layers):
            make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            masks[kind] = make(**mask_args)
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)
        for key, layer in self.layers.items():
            h = layer(h, attention_mask=masks[self._mask_kind[key]], position_ids=position_ids,
                      position_embeddings=position_embeddings)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def reset_rotary(self) -> None:
        """Recompute the rotary inverse frequencies (non-persistent: not in any checkpoint, and
        garbage after `to_empty`), as the HF rotary module's constructor does."""
        rot = self.rotary_emb
        device = rot.inv_freq.device
        if device.type == "meta":
            return
        if rot.rope_type == "default":
            inv_freq, scaling = rot.compute_default_rope_parameters(self.config, device=device)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rot.rope_type](self.config, device)
        rot.inv_freq = inv_freq.float()
        rot.original_inv_freq = inv_freq.float().clone()
        rot.attention_scaling = scaling

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Deterministic init, the same in every layout: HF's scheme (normal(0, initializer_range)
        for matrices, ones for norm weights, zeros for biases), each tensor drawn on the CPU from a
        generator keyed by (seed, its name), so FSDP/TP shards get their slice of the same full
        tensor. Also recomputes the rotary tables. While `weights_pending` (built by
        `build_hf_model`, not loaded yet) the parameters are only zeroed."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        self.reset_rotary()
        self._retie()
        if self.weights_pending:
            for param in self.parameters():
                if param.device.type != "meta":
                    (param.to_local() if hasattr(param, "to_local") else param).zero_()
            return
        std = float(getattr(self.config, "initializer_range", 0.02))
        for name, param in self.named_parameters():
            if param.device.type == "meta":
                continue
            name = name.replace("_checkpoint_wrapped_module.", "")
            if param.ndim == 1:
                full = torch.ones(param.shape) if "norm" in name.rsplit(".", 2)[-2] else torch.zeros(param.shape)
            else:
                gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
                full = torch.empty(param.shape).normal_(0.0, std, generator=gen)
            param.copy_(_local_like(full, param))

    def _retie(self) -> None:
        """`to_empty` gives each module its own new Parameter, which unties a tied output
        projection (measured on torch 2.13): point it back at the embedding's."""
        if (self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None
                and self.output.weight is not self.tok_embeddings.weight):
            self.output.weight = self.tok_embeddings.weight

    def tp_block_plan(self, sequence_parallel: bool) -> dict:
        """The decoder layer's TP plan from the config's `base_model_tp_plan` (`layers.*.` cut off):
        colwise -> ColwiseParallel, rowwise -> RowwiseParallel (one all-reduce per pair), and
        replicated_with_grad_allreduce (Qwen3's per-head q_norm/k_norm) -> a replicated DTensor
        weight whose input is sharded over the heads (dim -2), so its gradient is summed over the
        tp ranks. HF attention reads the local head count from `view(..., -1, head_dim)`."""
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
        )

        from meshrun.parallel.rules import check_hf_tp

        plan = layer_tp_plan(self.config)
        check_hf_tp(self.hf_dir, sequence_parallel, plan, TP_STYLES)
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                  "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True)}
        return {name: styles[style]() for name, style in plan.items()}


def _local_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full` as `param`'s kind of tensor: a DTensor parameter gets its local slice, no communication."""
    full = full.to(device=param.device, dtype=param.dtype)
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(param, DTensor):
            return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full
