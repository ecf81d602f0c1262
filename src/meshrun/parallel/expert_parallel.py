"""Expert parallel: each rank of the ep axis holds experts/ep routed experts, and tokens travel to them.

Technique: GShard's expert sharding (Lepikhin et al., arXiv:2006.16668) with token-choice
routing; the module boundary follows torchtitan's `ExpertParallel` style (a `ParallelStyle` whose
`distribute_module` shards the (experts, ...) weights on dim 0 and wraps the experts' forward
with a dispatch and a combine). Around the grouped experts' forward (meshrun.models.moe):

1. dispatch (forward pre-hook): the tokens are sorted by expert on arrival. The tokens per expert
   go first, with one even `all_to_all_single` of the (experts,) counts, so each rank learns how
   many rows it will receive from each peer; then the rows themselves with
   `torch.distributed._functional_collectives.all_to_all_single_autograd` (uneven splits; its
   backward is the reverse all-to-all). What arrives is ordered by (source rank, local expert);
   a stable sort regroups it by (local expert, source rank) for the expert loop.
2. combine (forward hook): the outputs are put back in arrival order and sent home with the
   reverse all-to-all, so the MoE block weights and scatters them as one process does.

An expert's gradient on its ep rank sums the contributions of every ep peer's tokens, so the
experts are wrapped by FSDP over the remaining data-parallel part (`ParallelDims.expert_fsdp_mesh`,
"efsdp") with the gradient divided by the whole data-parallel size (meshrun.parallel.fsdp), as
torchtitan does. A rank with no tokens for a peer still takes part in every collective (sizes 0).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


def expert_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The grouped-experts modules of `model`, with an int `num_experts` and only (num_experts, ...)
    parameters: the built-in model's, whose forward takes (tokens sorted by expert, tokens per
    expert), `routed_by_counts` (meshrun.models.moe.GroupedExperts), and a Hugging Face model's
    (`hf_routed`: transformers' `use_experts_implementation` experts, forward(hidden states,
    top-k expert ids, top-k weights), e.g. MixtralExperts). Routers and shared experts are not."""
    for module in model.modules():
        n = getattr(module, "num_experts", None) if (getattr(module, "routed_by_counts", False)
                                                      or hf_routed(module)) else None
        params = list(module.parameters(recurse=False))
        if isinstance(n, int) and params and all(p.dim() >= 2 and p.shape[0] == n for p in params):
            yield module


def hf_routed(module: nn.Module) -> bool:
    """Whether `module` is transformers' experts (MixtralExperts, Qwen2MoeExperts...): its class's
    forward dispatches on `config._experts_implementation` (transformers.integrations.moe)."""
    return hasattr(module, "_is_expert_parallel") and hasattr(getattr(module, "config", None),
                                                               "_experts_implementation")


class ExpertParallel(ParallelStyle):
    """Shard a grouped-experts module's weights on dim 0 over a 1-D ep mesh and route its tokens.

    The module's forward takes (tokens sorted by expert, tokens per expert as an (experts,)
    tensor) and returns one row per token in the same order. Counters for benchmarks/moe.py, bytes
    this rank sent to its ep peers in forward: `rows_bytes` (the tokens' rows, dispatch and
    combine; backward's reverse all-to-alls send as much again) and `counts_bytes`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rows_bytes = 0
        self.counts_bytes = 0

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=self._partition,
                                 input_fn=self._dispatch, output_fn=self._combine)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            # src_data_rank=None: every rank holds the same (or meta) full tensor; shard locally.
            shard = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None),
                                 requires_grad=param.requires_grad)
            module.register_parameter(pname, shard)

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, counts = inputs
        ep, group = mesh.size(), mesh.get_group()
        local = counts.shape[0] // ep
        # counts[e] rows go to the owner of expert e; learn, from each peer, its rows per local expert
        received = funcol.all_to_all_single(counts, None, None, group)
        received = torch.ops._c10d_functional.wait_tensor(received)
        fake = is_fake(counts)
        if fake:  # `meshrun plan --simulate`: no values, so a balanced exchange (the same work otherwise)
            send = recv = [x.shape[0] // ep] * ep
        else:
            send = counts.view(ep, local).sum(1).tolist()
            recv = received.view(ep, local).sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(x, recv, send, group)
        # (source, local expert) blocks -> (local expert, source): a stable sort on the block key
        block = torch.repeat_interleave(torch.arange(ep * local, device=x.device), received,
                                        output_size=rows.shape[0])
        order = torch.argsort((block % local) * ep + block // local, stable=True)
        module._ep_route = (order, send, recv)
        if fake:
            return rows[order], received.view(ep, local).sum(0)
        me = mesh.get_local_rank()
        self.rows_bytes += (sum(send) - send[me] + sum(recv) - recv[me]) * x.shape[1] * x.element_size()
        self.counts_bytes += (ep - 1) * local * counts.element_size()
        return rows[order], received.view(ep, local).sum(0)

    @staticmethod
    def _combine(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        order, send, recv = module._ep_route
        del module._ep_route
        back = torch.empty_like(out).index_copy(0, order, out)  # arrival order again
        return funcol.all_to_all_single_autograd(back, send, recv, mesh.get_group())


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[ExpertParallel]:
    """Shard every grouped-experts module of `model` over the 1-D `ep_mesh`, in place; the styles
    applied (also each module's `ep_style`, for its counters). Call before FSDP, like tensor parallel.
    A Hugging Face model's experts get their weights sharded the same way and compute through
    HF_EP_IMPLEMENTATION (see _hf_experts_forward)."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = []
    modules = list(expert_modules(model))
    for module in modules:  # what each computes with on its rank, before the config is switched
        if hf_routed(module) and module.config._experts_implementation != HF_EP_IMPLEMENTATION:
            module._meshrun_local_experts = module.config._experts_implementation or "eager"
    for module in modules:
        style = ExpertParallel()
        if hf_routed(module):  # its forward is transformers': the routing goes in through their interface
            ExpertParallel._partition("", module, ep_mesh)
            _route_hf_experts(module, ep_mesh)
        else:
            parallelize_module(module, ep_mesh, style)
        module.ep_style = style
        styles.append(style)
    return styles


# The name under which transformers' experts (a model.hf MoE) compute under expert parallel: a
# function registered in transformers' ExpertsInterface, which their forward looks up by
# `config._experts_implementation`, the one extension point transformers gives for it.
HF_EP_IMPLEMENTATION = "meshrun_expert_parallel"


def _route_hf_experts(module: nn.Module, mesh: DeviceMesh) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS[HF_EP_IMPLEMENTATION] = _hf_experts_forward
    module.config._experts_implementation = HF_EP_IMPLEMENTATION
    module._ep_mesh = mesh


class _LocalExperts:
    """What transformers' own experts forward sees of `module` on this ep rank: its local experts'
    weights (plain tensors, through DTensor's differentiable to_local) and their number; every
    other attribute (act_fn, the layout flags, _apply_gate) is the module's."""

    def __init__(self, module: nn.Module):
        self._module = module
        self._local = {name: p.to_local() if hasattr(p, "to_local") else p
                       for name, p in module.named_parameters(recurse=False)}
        self.num_experts = next(iter(self._local.values())).shape[0]

    def __getattr__(self, name: str):
        local = self.__dict__.get("_local", {})
        return local[name] if name in local else getattr(self.__dict__["_module"], name)


def _hf_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward under expert parallel: each (token, choice) slot goes to the
    ep rank holding its expert and back (ExpertParallel's dispatch and combine, as for the built-in
    model), the local experts compute with the model's own experts implementation (eager,
    grouped_mm...) on one slot per row at weight 1, and the router's weights mix the k outputs of
    each token at home."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    style, mesh = module.ep_style, module._ep_mesh
    tokens, k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)
    # a scatter, not bincount: its size is known without the values (`meshrun plan --simulate`)
    counts = torch.zeros(module.num_experts, dtype=torch.long, device=experts.device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    rows, local_counts = style._dispatch(module, (hidden_states[order // k], counts), mesh)
    local = _LocalExperts(module)
    ids = torch.repeat_interleave(torch.arange(local.num_experts, device=rows.device), local_counts,
                                  output_size=rows.shape[0])
    own = ALL_EXPERTS_FUNCTIONS.get_interface(module._meshrun_local_experts,
                                              type(module).forward.__wrapped__)
    out = own(local, rows, ids[:, None], torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype,
                                                        device=rows.device))
    back = style._combine(module, out, mesh)  # the slots in `order`
    weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
    slots = torch.empty_like(weighted).index_copy(0, order, weighted)  # slot order: token-major
    return slots.view(tokens, k, -1).sum(1).to(hidden_states.dtype)
