"""The mixture-of-experts feed-forward of the built-in decoder: a router, grouped experts, shared experts.

Token-choice top-k routing (Switch, arXiv:2101.03961; GShard, arXiv:2006.16668) with DeepSeekMoE's
shared experts (arXiv:2401.06066), balanced either by DeepSeek-V3's aux-loss-free expert bias or
its sequence-wise balance loss (arXiv:2412.19437, section 2.1.2). Names follow torchtitan's MoE,
and expert parallel (meshrun.parallel.expert_parallel) shards the experts on their first dim:
``router.gate``, ``experts.{w1,w2,w3}`` of shape (experts, ...), ``shared_experts.{w1,w2,w3}``.

Each forward in training adds its routing to this module's step totals (tokens per expert, the
balance loss, the router entropy); meshrun.train.moe_stats sums them over the ranks after each
optimizer step, updates the bias, and logs the figures. Nothing here communicates: under
expert parallel the all-to-alls run in hooks around GroupedExperts' forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from meshrun.errors import ConfigError
from meshrun.models.args import ModelArgs
from meshrun.models.feed_forward import FeedForward
from meshrun.parallel.pipeline import forward_is_step_work

# The experts' compute, by device and compute dtype (measured with torch 2.13 on CPU):
# torch._grouped_mm runs forward and backward in bf16, bitwise equal to the loop (any tokens per
# expert, zeros included, and under torch.compile), but fails in backward in fp32 and when no token
# at all reaches this rank's experts ("Invalid strides/sizes"). Elsewhere a loop over the experts,
# one matmul each on its own tokens. CUDA keeps the loop until grouped GEMM is checked on a GPU here
# (its kernels need sm90 and aligned token counts).
GROUPED_GEMM = "grouped GEMM (torch._grouped_mm)"
EXPERT_LOOP = "a loop over the experts"


def expert_compute(device_type: str, dtype: torch.dtype) -> str:
    """How the experts compute on `device_type` in `dtype` (the log names it)."""
    if device_type == "cpu" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return GROUPED_GEMM
    return EXPERT_LOOP


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls compute in: autocast's where it is on, else the inputs'."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, weight.dtype)
STATS = 4  # per layer, after the expert loads: balance-loss sum, forwards, entropy sum, tokens


class TokenChoiceRouter(nn.Module):
    """Scores every expert for each token and picks its top k; ties go to the lower expert index.

    Scores are softmax over the experts, or sigmoid per expert (DeepSeek-V3, with the bias).
    The bias only moves the choice; the weights that mix the chosen experts' outputs are the
    scores, renormalised over the k chosen when k > 1.
    """

    def __init__(self, dim: int, experts: int, top_k: int, sigmoid: bool):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.top_k, self.sigmoid = top_k, sigmoid

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, dim) -> weights (N, k), expert indices (N, k), scores (N, experts), in fp32."""
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        choice = scores.detach() if bias is None else scores.detach() + bias
        # A stable sort keeps equal scores in index order: deterministic ties, unlike topk.
        indices = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        weights = scores.gather(-1, indices)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices, scores


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU MLPs held as three (experts, ...) tensors: expert e is
    w2[e] (silu(w1[e] x) * w3[e] x)."""

    routed_by_counts = True  # forward(tokens sorted by expert, tokens per expert): what ep dispatches

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.num_experts = experts  # expert parallel (meshrun.parallel.expert_parallel) shards dim 0
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (sum(counts), dim), the tokens sorted by expert, counts[e] of them for expert e.

        Under expert parallel the weights are DTensors sharded on the expert dim, and x and
        counts are this rank's experts' tokens (the dispatch ran in a forward pre-hook): the
        compute (expert_compute: grouped GEMM or a loop) runs over the local shard."""
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        dtype = _compute_dtype(x, w1)
        if x.shape[0] and expert_compute(x.device.type, dtype) == GROUPED_GEMM:
            return experts_by_grouped_gemm(*(t.to(dtype) for t in (x, w1, w2, w3)), counts)  # as autocast casts
        return experts_by_loop(x, w1, w2, w3, counts)


def experts_by_grouped_gemm(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                            counts: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over tokens sorted by expert, three torch._grouped_mm calls (bf16 on CPU)."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)

    def grouped(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(inputs, weight.transpose(-2, -1), offs=offs)

    return grouped(F.silu(grouped(x, w1)) * grouped(x, w3), w2)


def experts_by_loop(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    """The same, one matmul per expert on its own tokens (any dtype, device, fake tensors)."""
    outs = []
    for e, part in enumerate(torch.split(x, _split_sizes(counts, x.shape[0]))):
        hidden = F.silu(part @ w1[e].t()) * (part @ w3[e].t())
        outs.append(hidden @ w2[e].t())
    return torch.cat(outs)


class _AddAuxiliaryLoss(torch.autograd.Function):
    """Returns x unchanged; in backward, `loss` receives gradient 1, as if it had been added to
    the training loss (DeepSeek-MoE's AddAuxiliaryLoss): no plumbing through the trainer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype = loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


def balance_loss(scores: torch.Tensor, indices: torch.Tensor, batch: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, mean over the sequences: sum_i f_i P_i with f_i
    = experts / (k T) x the tokens of the sequence routed to expert i, P_i = its mean (normalised)
    score. 1 when perfectly balanced. Per sequence, so data parallel averages it exactly."""
    n, experts = scores.shape
    top_k = indices.shape[1]
    probs = scores / scores.sum(dim=-1, keepdim=True)
    chosen = torch.zeros(n, experts, device=scores.device).scatter_(1, indices, 1.0)
    tokens = n // batch
    f = chosen.view(batch, tokens, experts).sum(1) * (experts / (top_k * tokens))
    p = probs.view(batch, tokens, experts).mean(1)
    return (f * p).sum(-1).mean()


class MoE(nn.Module):
    """The feed-forward of an MoE block: out = sum of the top-k experts' outputs, weighted by the
    router, plus the shared experts' output (a plain SwiGLU of width moe_hidden x shared)."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_experts, self.top_k = args.experts, args.experts_per_token
        self.balance, self.aux_coef, self.bias_rate = args.moe_balance, args.moe_aux_coef, args.moe_bias_rate
        self.router = TokenChoiceRouter(args.dim, args.experts, args.experts_per_token,
                                        sigmoid=args.moe_balance == "bias")
        self.experts = GroupedExperts(args.dim, args.moe_hidden, args.experts)
        self.shared_experts = (FeedForward(args.dim, args.moe_hidden * args.shared_experts)
                               if args.shared_experts else None)
        if self.balance == "bias":  # in checkpoints: a resumed run routes as the saved one did
            self.register_buffer("expert_bias", torch.zeros(args.experts))
        else:
            self.expert_bias = None
        # This step's totals (STATS after the loads): a plain attribute, not a buffer, so that DDP
        # does not broadcast rank 0's over the others' at every forward.
        self.step_stats: torch.Tensor | None = None
        # Forwards of this block per optimizer step (grad_accum x pipeline micro-batches; set by
        # meshrun.train.moe_stats): the balance loss's gradient is divided by it, as the training
        # loss is, so that the step trains on the mean balance loss over its micro-batches.
        self.forwards_per_step = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, indices, scores = self.router(flat, self.expert_bias)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, indices.flatten(), torch.ones_like(indices.flatten()))
        order = torch.argsort(indices.flatten(), stable=True)  # (token, slot) pairs by expert
        token_of = order // self.top_k
        routed = self.experts(flat[token_of], counts)
        routed = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros(flat.shape[0], dim, dtype=routed.dtype, device=routed.device)
        out = out.index_add(0, token_of, routed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        aux = None
        if self.training and self.balance == "aux_loss":
            aux = balance_loss(scores, indices, batch)
            if self.aux_coef:
                out = _AddAuxiliaryLoss.apply(out, aux * (self.aux_coef / self.forwards_per_step))
        # Count each micro-batch once: activation checkpointing runs this forward again inside
        # backward, and torch's pipeline runs it on its own to infer shapes.
        if self.training and torch._C._current_graph_task_id() == -1 and forward_is_step_work():
            self._add_stats(counts, aux, scores)
        return out.view(batch, seq, dim)

    @torch.no_grad()
    def _add_stats(self, counts: torch.Tensor, aux: torch.Tensor | None, scores: torch.Tensor) -> None:
        probs = scores / scores.sum(dim=-1, keepdim=True)
        entropy = -(probs * probs.clamp_min(1e-20).log()).sum()
        zero = scores.new_zeros(())
        aux_sum, forwards = (aux.detach().float(), zero + 1) if aux is not None else (zero, zero)
        extra = torch.stack([aux_sum, forwards, entropy, zero + scores.shape[0]])  # STATS columns
        row = torch.cat([counts.float(), extra])
        self.step_stats = row if self.step_stats is None else self.step_stats + row

    def take_stats(self) -> torch.Tensor | None:
        """This step's totals since the last call (None: no training forward), and reset them."""
        stats, self.step_stats = self.step_stats, None
        return stats

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's aux-loss-free update after an optimizer step, from the load of every
        rank: an expert above the mean load gets its bias lowered by bias_rate, one below raised."""
        if self.expert_bias is not None:
            load = load.to(self.expert_bias.device, torch.float32)
            self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """A fresh bias (after a meta build's to_empty, or for a new run)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def check_training(args: ModelArgs, *, dtype: str, fault_mode: str = "exact") -> None:
    """What the mixture of experts refuses of a run's training settings (checked before launch)."""
    if args.experts and args.moe_balance == "bias" and fault_mode == "torchft":
        raise ConfigError("model.moe_balance='bias' with fault.mode='torchft': the load is summed within one "
                          "replica group, so each group would move its own bias apart from the others'; use "
                          "model.moe_balance='aux_loss' or 'none', or fault.mode='exact'")
    if args.experts and args.moe_balance == "aux_loss" and args.moe_aux_coef and dtype == "fp16":
        raise ConfigError("model.moe_balance='aux_loss' with train.dtype='fp16': the balance loss's gradient "
                          "bypasses fp16's loss scale (it would act 1/loss_scale as strong); use train.dtype="
                          "'bf16' or 'fp32', or model.moe_balance='bias'")


def _split_sizes(counts: torch.Tensor, total: int) -> list[int]:
    """Tokens per expert on the host; under fake tensors (`meshrun plan --simulate`) the values
    are unknown, so an even split of the `total` routed slots: the memory of a balanced step."""
    if not is_fake(counts):
        return counts.tolist()
    experts = counts.shape[0]
    return [total // experts + (e < total % experts) for e in range(experts)]


def moe_metrics(table: torch.Tensor) -> dict[str, float]:
    """The figures of one step from the (MoE layers, experts + STATS) totals of every rank.

    ``moe_load_max_over_mean``: the worst layer's max over mean tokens per expert (1 = balanced,
    experts / k = all on k experts); ``moe_tokens_dropped``: 0, as nothing caps an expert's
    tokens; ``moe_router_entropy``: the mean entropy (nats) of a token's normalised scores;
    ``moe_aux_loss`` (moe_balance='aux_loss'): the balance loss averaged over layers and forwards.
    """
    table = table.double()
    experts = table.shape[1] - STATS
    load = table[:, :experts]
    aux_sum, forwards, entropy, tokens = (table[:, experts + i] for i in range(STATS))
    figures = {
        "moe_load_max_over_mean": float((load.max(1).values / load.mean(1).clamp_min(1e-12)).max()),
        "moe_tokens_dropped": 0,
        "moe_router_entropy": float((entropy / tokens.clamp_min(1)).mean()),
    }
    if bool((forwards > 0).all()):
        figures["moe_aux_loss"] = float((aux_sum / forwards).mean())
    return figures
