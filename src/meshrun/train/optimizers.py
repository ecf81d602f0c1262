"""The optimizer of one model part: AdamW, Adam, SGD, Adafactor or Muon, all from `torch.optim`.

    optimizer = build_optimizer(part, cfg.optim)   # after the part is sharded and materialised

Weight decay goes to matrices and embeddings only (params of 2 or more dims), never to norm gains
or biases: nanoGPT's convention (and GPT-2's), which keeps the decayed set the same whatever the
layout. Muon (Jordan et al., 2024, https://kellerjordan.github.io/posts/muon/) orthogonalises the
update of hidden weight matrices only; as torch.optim.Muon's docs ask, the embedding, the output
head, gains and biases go to an AdamW beside it (`MuonWithAdamW`), with Muon's lr adjusted to
match AdamW's update RMS (`adjust_lr_fn="match_rms_adamw"`, Liu et al., arXiv:2502.16982) so one
`optim.lr` serves both. `optim.implementation = "auto"` takes torch's fused kernel where the
optimizer has one for the parameters' device, else torch's own default (foreach on GPUs, the
for-loop on CPU, where foreach measured 0.6-1.0x the for-loop and fused 1.7-14x:
benchmarks/optimizer_kernels.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshrun.config.sections import FOREACH, FUSED  # the config's choices (checked there, no torch)
from meshrun.parallel.rules import check_optimizer_shards, updates_shards

FUSED_DEVICES = ("cpu", "cuda", "mps", "xpu")  # devices torch.optim's fused kernels run on (torch 2.13)
HEAD_NAMES = ("output", "lm_head")  # output layers Muon leaves to AdamW (built-in, HF)


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Params of 2+ dims with `weight_decay`, the rest (gains, biases) without; each of the two
    split further by the kind of tensor, so that no group mixes plain tensors with DTensors, or
    DTensors of different meshes: torch's fused and foreach kernels take one kind per call ("got
    mixed torch.Tensor and DTensor", measured on torch 2.13 under TP over the whole world, where
    norms stay plain beside DTensor biases). Checkpoints keep each parameter's options by name
    (flattened optimizer state), so the grouping may differ between layouts."""
    groups: dict[tuple, dict] = {}
    for param in params:
        if not param.requires_grad:
            continue
        decay = param.dim() >= 2
        key = (not decay, isinstance(param, DTensor))
        groups.setdefault(key, {"params": [], "weight_decay": weight_decay if decay else 0.0})["params"].append(param)
    return [groups[key] for key in sorted(groups)]


def muon_params(model: nn.Module) -> set[nn.Parameter]:
    """The hidden weight matrices: weights of `nn.Linear` modules other than the output head."""
    chosen = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in HEAD_NAMES:
            if module.weight.requires_grad and module.weight.dim() == 2:
                chosen.add(module.weight)
    return chosen


def implementation_kwargs(name: str, implementation: str, params: list[nn.Parameter]) -> dict:
    """`fused` / `foreach` arguments for torch.optim.<name> (checked by OptimSection.validate,
    and against DTensor parameters by meshrun.parallel.rules.check_optimizer_shards)."""
    sharded = any(isinstance(p, DTensor) for p in params)
    if sharded:
        check_optimizer_shards(name, implementation)
    if implementation == "auto":
        fusable = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
        fusable = fusable and (not sharded or updates_shards(name, "fused"))
        if not (name in FUSED and fusable):
            return {}  # torch's default: foreach on accelerators, the for-loop on CPU
        implementation = "fused"
    if implementation == "fused":
        return {"fused": True}
    if name not in FOREACH:
        return {}
    return {"foreach": implementation == "foreach"}


def _torch_optimizer(name: str, groups: list[dict], optim_cfg, impl: dict) -> torch.optim.Optimizer:
    lr = optim_cfg.lr
    betas = (optim_cfg.beta1, optim_cfg.beta2)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=optim_cfg.eps, **impl)
    if name == "adam":  # weight decay as L2 on the gradient (AdamW decouples it)
        return torch.optim.Adam(groups, lr=lr, betas=betas, eps=optim_cfg.eps, **impl)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=optim_cfg.momentum, nesterov=optim_cfg.nesterov, **impl)
    if name == "adafactor":  # its own eps and beta2 schedule (torch's defaults)
        return torch.optim.Adafactor(groups, lr=lr, **impl)
    raise AssertionError(f"unknown optimizer {name!r}")  # OptimSection.validate checks optim.name


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    """`optim_cfg.name` over `model`'s trainable params, decay groups and kernel as configured."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optim_cfg.name != "muon":
        impl = implementation_kwargs(optim_cfg.name, optim_cfg.implementation, params)
        return _torch_optimizer(optim_cfg.name, param_groups(params, optim_cfg.weight_decay), optim_cfg, impl)
    hidden = muon_params(model)
    rest = [p for p in params if p not in hidden]
    muon = torch.optim.Muon([p for p in params if p in hidden], lr=optim_cfg.lr,
                            weight_decay=optim_cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    impl = implementation_kwargs("adamw", optim_cfg.implementation, rest)
    adamw = _torch_optimizer("adamw", param_groups(rest, optim_cfg.weight_decay), optim_cfg, impl) if rest else None
    return MuonWithAdamW(muon, adamw)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the hidden matrices and AdamW for the rest, stepped as one optimizer.

    `param_groups` is the two optimizers' groups (the same dicts), so an LR scheduler or a
    gradient scaler that walks them reaches both. Checkpoints save and load `optimizers`, the
    two torch optimizers (torch.distributed.checkpoint takes a list of them per model part).
    """

    @property
    def param_groups(self) -> list[dict]:
        # Read anew each time: an inner load_state_dict replaces its group dicts, and a list
        # kept from before would leave the scheduler setting the lr of groups no longer used.
        return [g for o in self.optimizers for g in o.param_groups]

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer | None):
        # No super().__init__: the groups and state belong to the two inner optimizers.
        self.optimizers = tuple(o for o in (muon, adamw) if o is not None)
        self.defaults = dict(muon.defaults)
        self.state = {}  # per-parameter state lives in the inner optimizers
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MuonWithAdamW takes no closure"
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        for optimizer, own in zip(self.optimizers, state_dict["optimizers"], strict=True):
            optimizer.load_state_dict(own)

