"""Any Hugging Face decoder-only causal LM, seen through meshrun's model protocol.

    model = build_hf_model("path/to/hf_dir", vocab_size=tokenizer.vocab_size)   # under torch.device("meta")

`transformers` builds the model from the directory's config.json with its own modeling code
(`AutoModelForCausalLM`, `trust_remote_code=False`); no list of families, no per-architecture
code here. From the module tree (`HFParts.find`) the adapter takes the pieces meshrun's layouts
address, under meshrun's names (`models.factory.ModelProtocol`):
- `tok_embeddings`: the input embedding (`get_input_embeddings()`: `model.embed_tokens`, GPT-2's
  `transformer.wte`, GPT-NeoX's `gpt_neox.embed_in`);
- `layers`: an `nn.ModuleDict` "0".."N-1" of the decoder layers (the base model's one
  `nn.ModuleList` of `num_hidden_layers` modules);
- `norm`: the base model's one child with parameters after the layers (the final norm), if any;
- `output`: the head (`get_output_embeddings()`), the embedding's own Parameter when tied;
- `input_parts`: other base-model children with parameters, before the layers (GPT-2's
  position embedding `wpe`): the first pipeline stage owns them, as it owns `tok_embeddings`;
- `extras`: base-model children with buffers only (rotary tables), which every stage keeps.
Below each of these every name is transformers' own, so `HFParts.prefixes` maps a state dict
both ways (models/hf_keys.py).

`forward(tokens)` runs transformers' own forward of the whole causal LM (positions, masks,
rotary tables, embedding scales, logit soft-capping: whatever the architecture does), after
pointing the transformers module tree at the adapter's current pieces (`_sync`): an activation-
checkpointed layer is its wrapper, and in a pipeline stage a layer the stage does not own is a
pass-through, a missing final norm an identity, a missing input part a stub. A stage without
`tok_embeddings` takes hidden states (B, T, hidden): they go in as `inputs_embeds`, so the model
prepares its masks and rotary tables as it would, and they replace whatever the model made of
them at the stage's first layer (`_Enter`); a stage without `output` returns hidden states.

Non-persistent buffers (rotary inverse frequencies, Gemma's embedding scale) are computed at
build: the model is built with its parameters on the meta device and its buffers real
(accelerate's `init_empty_weights(include_buffers=False)`), and `init_weights` puts these values
back after `to_empty`. The weights come from the directory's safetensors (`meshrun.models.hf_load`),
straight into each rank's shards.
"""

from __future__ import annotations

import copy
import zlib
from typing import Any

import torch
from torch import nn

from meshrun.errors import ModelError
from meshrun.extras import missing_extra_message
from meshrun.models.hf_config import (
    TP_STYLES,
    context_parallel_refusal,
    hf_routed_experts,
    layer_tp_plan,
    model_args_from_hf,
    read_hf_config,
)
from meshrun.models.hf_load import local_like
from meshrun.models.hf_parts import (
    HFParts,
    _annotated_arity,
    _Enter,
    _Leave,
    _Skip,
    _StageDone,
    _Stub,
)
from meshrun.models.meta import retie_output


def build_hf_model(path: str, vocab_size: int | None = None, *, seed: int | None = None,
                   tie_embeddings: bool | None = None) -> HFCausalLM:
    """The adapter over the HF model of directory `path`, built on the ambient device.

    On the meta device it holds shapes only (the layout materialises and loads this rank's
    share); on a real device the directory's weights are loaded into it (one process).
    `tie_embeddings=False` unties a model whose config ties its head to its embedding: the head
    becomes its own matrix, loaded as a copy of the embedding (model.tie_embeddings = false).
    """
    read_hf_config(path)  # the directory's own checks first, one line each
    config = _hf_config(path)
    args = model_args_from_hf(path, vocab_size, config)  # the shape as transformers reads it; the vocabulary
    model = HFCausalLM(path, args, untie=tie_embeddings is False and args.tie_embeddings, config=config)
    model.weights_pending = True  # materialise cheaply: the directory's weights come next
    if not any(p.is_meta for p in model.parameters()):
        from meshrun.models.hf_load import load_hf_weights

        model.init_weights(seed)  # the buffers
        load_hf_weights([model], path)
    return model


def _hf_config(path: str) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ModelError(missing_extra_message("transformers", "model.hf")) from None
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:  # an unknown model_type, remote code, a bad file
        text = " ".join(str(exc).split())[:200]
        raise ModelError(f"model.hf={path!r}: transformers cannot read its config.json ({type(exc).__name__}: "
                         f"{text}); give a causal LM this transformers ships") from None
    if getattr(config, "is_encoder_decoder", False):  # before its shape: an encoder-decoder has other keys
        raise ModelError(f"model.hf={path!r}: model_type {config.model_type!r} is an encoder-decoder; meshrun "
                         "trains decoder-only causal LMs")
    return config


class HFCausalLM(nn.Module):
    """`model(tokens) -> logits` (B, T, vocab) over a transformers causal LM.

    `args` is the built-in `ModelArgs` with this model's shape (what the layout rules, the
    planner and the FLOPs count read); `config` is the transformers config; `hf_dir` the source;
    `parts` where each piece sits in the transformers model. A pipeline stage deletes blocks from
    `layers` and sets `tok_embeddings` / `input_parts` / `norm` / `output` to None: without
    `tok_embeddings` the input is hidden states (B, T, hidden_size), without `output` the result is.
    """

    compiles_whole = False  # transformers' top level is not checked to trace as one graph: per-layer graphs

    def __init__(self, path: str, args: Any, *, untie: bool = False, config: Any = None):
        super().__init__()
        try:
            from accelerate import init_empty_weights
            from transformers import AutoModelForCausalLM
        except ImportError as exc:
            raise ModelError(missing_extra_message(exc.name or "transformers", "model.hf")) from None

        config = config if config is not None else _hf_config(path)  # read once by build_hf_model
        if untie:
            import dataclasses

            config.tie_word_embeddings = False
            args = dataclasses.replace(args, tie_embeddings=False)
        where = f"model.hf={path!r}"
        try:
            if torch.get_default_device().type == "meta":
                # Parameters on meta, buffers real: the values non-persistent buffers get from
                # their constructors (rotary tables), which `to_empty` would otherwise lose.
                with torch.device("cpu"), init_empty_weights(include_buffers=False):
                    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
                hf.tie_weights()  # the patched register_parameter gave the tied head its own meta Parameter
            else:
                hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
        except ValueError as exc:  # "Unrecognized configuration class ... for AutoModelForCausalLM"
            text = " ".join(str(exc).split())[:200]
            raise ModelError(f"{where}: transformers has no causal LM for model_type "
                             f"{config.model_type!r} ({text})") from None
        parts = HFParts.find(hf, where)
        base = hf.get_submodule(parts.base)
        self.hf_dir, self.args, self.config, self.parts = path, args, hf.config, parts
        self.routed_experts = hf_routed_experts(path)  # what parallel.ep splits (resolve.ModelShape)
        self.tok_embeddings: nn.Module | None = getattr(base, parts.embed)
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(getattr(base, parts.layers))})
        self.norm: nn.Module | None = getattr(base, parts.norm) if parts.norm else None
        self.output: nn.Module | None = getattr(hf, parts.head)
        self.input_parts: nn.ModuleDict | None = (
            nn.ModuleDict({n: getattr(base, n) for n in parts.input_parts}) if parts.input_parts else None)
        self.extras = nn.ModuleDict({n: getattr(base, n) for n in parts.extras})
        self.head_from_embedding = untie
        """The config ties the head to the embedding and model.tie_embeddings=false untied it: the
        directory's files hold no head, which starts as a copy of the embedding (models/hf_load.py)."""
        self.weights_pending = False
        """True until `load_hf_weights` filled the parameters: `init_weights` then only zeroes them
        (no full-size random tensors drawn, which would cost memory, for values about to be replaced)."""
        self.__dict__["_hf"] = hf  # transformers' tree over the same modules, not registered twice
        self.__dict__["_n_layers"] = len(self.layers)
        self.__dict__["_layer_attrs"] = [
            {k: v for k, v in vars(layer).items() if not k.startswith("_") and isinstance(v, (str, int, float, bool))}
            for layer in self.layers.values()]
        self.__dict__["_buffer_values"] = {
            name: buf.detach().clone() for name, buf in self.named_buffers() if not buf.is_meta}

    def train(self, mode: bool = True) -> HFCausalLM:
        """Also transformers' own tree: its modules without state (a base model's dropout) are
        not registered here, and would otherwise stay in training mode through an eval."""
        self.__dict__["_hf"].train(mode)
        return super().train(mode)

    @property
    def tied(self) -> bool:
        return (self.output is not None and self.tok_embeddings is not None
                and self.output.weight is self.tok_embeddings.weight)

    def _sync(self, hidden: torch.Tensor | None) -> None:
        """Point transformers' module tree at the adapter's current pieces (see the module doc)."""
        hf, parts = self.__dict__["_hf"], self.parts
        base = hf.get_submodule(parts.base)
        seq: list[nn.Module] = []
        mine = [index for index in range(self.__dict__["_n_layers"]) if str(index) in self.layers]
        arity = _annotated_arity(_unwrapped(self.layers[str(mine[0])])) if mine else 0
        for index in range(self.__dict__["_n_layers"]):
            layer = self.layers[str(index)] if str(index) in self.layers else None
            if layer is None:
                seq.append(_Skip(arity, self.__dict__["_layer_attrs"][index]))  # only those before the stage's first layer run
                continue
            if self.output is None and index == mine[-1]:
                layer = _Leave(layer)
            if hidden is not None and not any(isinstance(m, _Enter) for m in seq):
                layer = _Enter(layer, hidden)
            seq.append(layer)
        base._modules[parts.layers] = nn.ModuleList(seq)
        base._modules[parts.embed] = self.tok_embeddings if self.tok_embeddings is not None else _Stub(hidden)
        if parts.norm:
            base._modules[parts.norm] = self.norm if self.norm is not None else nn.Identity()
        for name in parts.input_parts:
            owned = self.input_parts is not None and name in self.input_parts
            base._modules[name] = self.input_parts[name] if owned else _Stub(hidden)
        for name in parts.extras:
            base._modules[name] = self.extras[name]
        if self.output is not None:
            hf._modules[parts.head] = self.output

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the sequence positions of ``tokens``' columns, (T,) or per row (B, T)
        (default 0..T-1): context parallel's share of a sequence, given to the model as its
        `position_ids`. ``documents``: packed examples (meshrun.data.packing); transformers finds
        the same ones from the `position_ids` (restarting per example) and masks attention at their
        boundaries itself (`check_packing` refuses a model that would not)."""
        hf = self.__dict__["_hf"]
        first = self.tok_embeddings is not None
        seqlen = tokens.shape[1]
        if seqlen > self.args.max_seq_len:
            raise ModelError(f"sequence length {seqlen} exceeds the max_position_embeddings="
                             f"{self.args.max_seq_len} of model.hf={self.hf_dir!r}; lower data.seq_len")
        self._sync(None if first else tokens)
        # a copy: some models scale inputs_embeds in place (CTRL), which autograd refuses on the
        # stage input (a leaf that requires grad); `_Enter` still feeds the input itself to the layer
        inputs = {"input_ids": tokens} if first else {"inputs_embeds": tokens.clone()}
        if positions is not None:
            inputs["position_ids"] = positions if positions.dim() == 2 else positions.expand(tokens.shape[0], -1)
        if self.output is not None:
            return hf(**inputs, use_cache=False).logits
        try:
            return hf.get_submodule(self.parts.base)(**inputs, use_cache=False).last_hidden_state
        except _StageDone as done:  # the stage's last layer ran (`_Leave`)
            return done.hidden

    def retie(self) -> None:
        """A tied head tied again after `to_empty` (what a fake build does instead of init_weights)."""
        retie_output(self)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Deterministic init, the same in every layout: the buffers get the values computed at
        build; each parameter gets transformers' own initialisation of its module
        (`_init_weights`), drawn on the CPU from a generator keyed by (seed, its name), so FSDP/TP
        shards get their slice of the same full tensor. While `weights_pending` (built by
        `build_hf_model`, not loaded yet) the parameters are only zeroed."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        values = self.__dict__["_buffer_values"]
        for name, buf in self.named_buffers():
            key = name.replace("_checkpoint_wrapped_module.", "")
            if key in values and not buf.is_meta:
                buf.copy_(local_like(values[key], buf))
        retie_output(self)  # a meta build's `to_empty` untied them
        if self.weights_pending:
            for param in self.parameters():
                if param.device.type != "meta":
                    (param.to_local() if hasattr(param, "to_local") else param).zero_()
            return
        hf = self.__dict__["_hf"]
        for mod_name, module in self.named_modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.device.type != "meta"]
            if not own:
                continue
            name = f"{mod_name}.{own[0][0]}".replace("_checkpoint_wrapped_module.", "")
            for pname, full in _hf_init(hf, module, (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63).items():
                param = getattr(module, pname)
                param.copy_(local_like(full, param))

    def tp_block_plan(self, sequence_parallel: bool) -> dict:
        """The decoder layer's TP plan from the config's `base_model_tp_plan` (`layers.*.` cut off),
        each entry that names a module of the layer (a mixture-of-experts layer has no `mlp.up_proj`):
        colwise -> ColwiseParallel, rowwise -> RowwiseParallel (one all-reduce per pair);
        colwise_gather_output / rowwise_split_input (a fused qkv or gate_up, or q/k norms over all
        heads, need the whole output) -> the same with the output gathered / the replicated input
        split locally; replicated_with_grad_allreduce (per-head q_norm/k_norm) -> a replicated
        DTensor weight whose input is sharded over the heads (dim -2), so its gradient is summed
        over the tp ranks. transformers' attention reads the local head count from
        `view(..., -1, head_dim)`."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
        )

        from meshrun.parallel.rules import check_hf_tp

        plan = layer_tp_plan(self.config)
        check_hf_tp(self.hf_dir, sequence_parallel, plan, TP_STYLES)
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                  "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
                  "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
                  "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True)}
        layer = _unwrapped(next(iter(self.layers.values())))
        present = {name for name, _ in layer.named_modules()}
        return {name: styles[style]() for name, style in plan.items() if name in present}

    def enable_context_parallel(self, cp: int) -> None:
        """Attention through `CP_ATTENTION` (`cp_attention`) from now on: causal SDPA without a
        mask, which context parallel runs as a ring. transformers builds no mask for an
        implementation it has no mask function for, so the head-tail positions of a cp share are
        not taken for packed sequences. One ModelError line when the architecture cannot."""
        from transformers import AttentionInterface

        hf = self.__dict__["_hf"]
        where = f"parallel.cp={cp} with model.hf={self.hf_dir!r}"
        reason = context_parallel_refusal(self.config.to_dict())
        if not reason and not type(hf)._supports_attention_backend:
            reason = f"{type(hf).__name__} computes attention in its own code, not through transformers' attention interface"
        if reason:
            raise ModelError(f"{where}: {reason}; set parallel.cp=1")
        AttentionInterface.register(CP_ATTENTION, cp_attention)
        hf.set_attn_implementation(CP_ATTENTION)

    def check_packing(self) -> None:
        """data.packing: transformers masks packed examples apart (from the position_ids) in the
        masks it builds for its attention interface; a model that computes attention in its own
        code might not, so it is refused in one line."""
        hf = self.__dict__["_hf"]
        if not type(hf)._supports_attention_backend:
            raise ModelError(f"data.packing=true with model.hf={self.hf_dir!r}: {type(hf).__name__} computes "
                             "attention in its own code, which may attend across packed examples; set data.packing=false")

    def check_layout(self, tp: int, pp: int) -> None:
        """What this architecture's structure cannot do under the layout, as one ConfigError line
        naming a layout that works (before launch, on the model built on meta). A tied head under
        pp is the layout rules' (rules.check_tied_pipeline, from `args.tie_embeddings`)."""
        from meshrun.parallel.rules import check_hf_pp_order, check_hf_tp

        if tp > 1:
            check_hf_tp(self.hf_dir, False, layer_tp_plan(self.config), TP_STYLES, tp, self.config.model_type)
        if pp > 1:
            check_hf_pp_order(self.hf_dir, pp, self.parts.unordered)


CP_ATTENTION = "meshrun_context_parallel"
"""The name `enable_context_parallel` registers `cp_attention` under in transformers' AttentionInterface."""


def cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, causal and without a mask (what context parallel's ring
    computes); anything that would make it another attention stops with one line."""
    extra = [name for name in ("sliding_window", "softcap", "s_aux", "position_bias") if kwargs.get(name) is not None]
    if attention_mask is not None:
        extra.append("attention_mask")
    if dropout:
        extra.append(f"dropout={dropout}")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        extra.append("is_causal=False")
    if extra:
        raise ModelError(f"context parallel (parallel.cp > 1) splits causal attention only, but {type(module).__name__} "
                         f"asks for {', '.join(extra)}; set parallel.cp=1")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, dropout=0.0, scaling=scaling, is_causal=True)


def _unwrapped(block: nn.Module) -> nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)


def _hf_init(hf: nn.Module, module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """transformers' initialisation (`hf._init_weights`) of `module`'s own parameters, as full
    CPU tensors drawn with `seed`: on a parameter-free copy of the module given full-size CPU
    parameters, so a sharded module (DTensor parameters) gets the values of the whole tensor."""
    clone = copy.copy(module)
    clone._parameters = {n: nn.Parameter(torch.empty(tuple(p.shape), dtype=p.dtype))
                         for n, p in module.named_parameters(recurse=False)}
    clone._buffers = {n: (torch.empty(tuple(b.shape), dtype=b.dtype) if b is not None else None)
                      for n, b in module._buffers.items()}
    clone._modules = {}
    for p in clone._parameters.values():
        p.zero_()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            hf._init_weights(clone)
        except Exception:  # noqa: BLE001 - an init that needs the module's children: its parameters stay zero
            pass
    return {n: p.detach() for n, p in clone._parameters.items()}


def hf_parts(path: str, tie_embeddings: bool | None = None) -> HFParts:
    """The pieces of the HF model of directory `path`, from a build on the meta device."""
    from meshrun.models.meta import on_meta

    with on_meta():
        return build_hf_model(path, tie_embeddings=tie_embeddings).parts
