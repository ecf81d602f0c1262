"""The built-in mixture of experts (meshrun.models.moe): routing, balancing, counts, refusals.

The distributed parity of tiny-moe (FSDP, DDP, the bias's all-reduced load) is
tests/distributed/test_moe_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import meshrun_each
from torch.utils.checkpoint import checkpoint

from meshrun.config import as_dict, load_config
from meshrun.errors import ConfigError, ModelError
from meshrun.models.args import ModelArgs, flops_per_token
from meshrun.models.llama import Transformer, num_params
from meshrun.models.moe import STATS, MoE, moe_metrics
from meshrun.models.sizes import get_size, size_spec
from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
from meshrun.train.moe_stats import MoEStats

SMALL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def moe_args(**kw) -> ModelArgs:
    return ModelArgs(**{**SMALL, "experts": 4, "experts_per_token": 2, "shared_experts": 1, **kw})


def test_dense_is_unchanged_and_has_no_moe():
    dense = Transformer(ModelArgs(**SMALL), seed=0)
    assert not any(isinstance(m, MoE) for m in dense.modules())
    assert MoEStats.of([dense], dense.args) is None  # no collective, no bookkeeping
    assert all(".feed_forward.w" in n for n in dense.state_dict() if "feed_forward" in n)


def test_moe_layers_sizes_and_names():
    args = moe_args(n_layers=4, moe_every=2)
    assert [args.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert args.moe_hidden == 8 * math.ceil(args.ffn_hidden / 3 / 8)  # auto: width / (top-k + shared)
    model = Transformer(args, seed=0)
    names = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("layers.1.feed_forward")}
    h = args.moe_hidden
    assert names == {"layers.1.feed_forward.router.gate.weight": (4, 32),
                     "layers.1.feed_forward.experts.w1": (4, h, 32),
                     "layers.1.feed_forward.experts.w2": (4, 32, h),
                     "layers.1.feed_forward.experts.w3": (4, h, 32),
                     "layers.1.feed_forward.shared_experts.w1.weight": (h, 32),
                     "layers.1.feed_forward.shared_experts.w2.weight": (32, h),
                     "layers.1.feed_forward.shared_experts.w3.weight": (h, 32)}
    assert "layers.1.feed_forward.expert_bias" in model.state_dict()  # checkpointed: resume routes alike


@pytest.mark.parametrize("kw", [dict(), dict(moe_every=2, n_layers=4, shared_experts=0, tie_embeddings=True)])
def test_num_params_counts_every_expert_and_flops_only_active(kw):
    args = moe_args(**kw)
    model = Transformer(args, seed=0)
    assert args.num_params() == num_params(model)
    assert args.num_params(exclude_embeddings=True) == num_params(model, exclude_embeddings=True)
    idle = args.num_moe_layers * (args.experts - args.experts_per_token) * 3 * args.dim * args.moe_hidden
    assert args.num_params(active=True) == args.num_params() - idle
    plain = ModelArgs(**{**SMALL, **{k: v for k, v in kw.items() if k == "tie_embeddings"}})
    assert plain.num_params(active=True) == plain.num_params()  # dense: the same count
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 16
    tied = args.vocab_size * args.dim if args.tie_embeddings else 0
    assert flops_per_token(args, 16) == 6 * (args.num_params(exclude_embeddings=True, active=True) + tied) + attention
    tiny_moe = get_size("tiny-moe")
    assert tiny_moe.num_params(active=True) == pytest.approx(get_size("tiny").num_params(), rel=0.01)


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts one at a time (what the grouped loop must equal)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, indices, _ = moe.router(flat, moe.expert_bias)
    e = moe.experts
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for slot in range(moe.top_k):
            i = int(indices[t, slot])
            h = F.silu(flat[t] @ e.w1[i].t()) * (flat[t] @ e.w3[i].t())
            out[t] += weights[t, slot] * (h @ e.w2[i].t())
    return (out + moe.shared_experts(flat)).view_as(x)


@pytest.mark.parametrize("balance", ["bias", "aux_loss", "none"])
def test_top_k_output_matches_a_per_token_reference(balance):
    model = Transformer(moe_args(moe_balance=balance), seed=3)
    moe = model.layers["0"].feed_forward
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-6, rtol=1e-5)
    weights, indices, _ = moe.router(x.reshape(-1, 32), moe.expert_bias)
    assert indices.shape == (10, 2) and all(len(set(row.tolist())) == 2 for row in indices)
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))  # top-2 renormalised
    again = Transformer(moe_args(moe_balance=balance), seed=3).layers["0"].feed_forward
    assert torch.equal(again(x), moe(x))  # the same seed routes and computes the same


def test_ties_go_to_the_lower_expert_index():
    moe = Transformer(moe_args(experts=6, experts_per_token=3), seed=0).layers["0"].feed_forward
    with torch.no_grad():
        moe.router.gate.weight.zero_()  # every score equal
    _, indices, _ = moe.router(torch.randn(7, 32))
    assert indices.tolist() == [[0, 1, 2]] * 7


def test_bias_moves_the_choice_not_the_weights_and_follows_the_load():
    moe = Transformer(moe_args(moe_bias_rate=0.5), seed=0).layers["0"].feed_forward
    with torch.no_grad():
        moe.router.gate.weight.zero_()
    moe.update_bias(torch.tensor([4.0, 2.0, 1.0, 1.0]))  # mean 2: over, equal, under, under
    assert moe.expert_bias.tolist() == [-0.5, 0.0, 0.5, 0.5]
    weights, indices, scores = moe.router(torch.randn(3, 32), moe.expert_bias)
    assert indices.tolist() == [[2, 3]] * 3  # the under-loaded experts win the (tied) choice
    torch.testing.assert_close(weights, torch.full((3, 2), 0.5))  # from the sigmoid scores, not the bias
    moe.reset_buffers()
    assert moe.expert_bias.tolist() == [0.0] * 4


def test_aux_loss_gradient_reaches_the_router_alone():
    for coef, reaches in ((0.01, True), (0.0, False)):
        model = Transformer(moe_args(moe_balance="aux_loss", moe_aux_coef=coef), seed=0)
        model(torch.randint(0, 64, (2, 8))).sum().mul(0).backward()  # only the balance loss pulls
        gate = model.layers["0"].feed_forward.router.gate.weight.grad
        assert (gate is not None and gate.abs().sum() > 0) == reaches
        last = model.layers["1"].feed_forward.experts.w1.grad  # no later block's balance loss reads it
        assert last is None or last.abs().sum() == 0


def test_grad_accum_trains_on_the_mean_balance_loss_as_one_batch_does():
    """The balance loss's gradient is divided by the forwards of a step (MoEStats sets it), as the
    training loss is: 2 micro-batches of 2 sequences give one batch of 4's gradients (the balance
    loss is a mean over sequences). Undivided, the balance term counted twice (checked: it differs)."""
    from meshrun.train.step import train_step

    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(3))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    args = moe_args(moe_balance="aux_loss", moe_aux_coef=1.0)

    def gradients(grad_accum: int, divide: bool) -> dict[str, torch.Tensor]:
        model = Transformer(args, seed=0)
        MoEStats.of([model], args, forwards_per_step=grad_accum if divide else 1)
        seen = {}

        class Recording(torch.optim.SGD):  # the step's gradients, before train_step clears them
            def step(self, closure=None):
                seen.update((name, p.grad.clone()) for name, p in model.named_parameters() if p.grad is not None)

        rows = 4 // grad_accum
        batches = iter([(inputs[i:i + rows], targets[i:i + rows]) for i in range(0, 4, rows)])
        train_step(model, Recording(model.parameters(), lr=0.0), batches, grad_accum=grad_accum,
                   device=torch.device("cpu"), dtype="fp32", grad_clip=0.0)
        assert len(seen) > 10, seen.keys()
        return seen

    whole, split, undivided = gradients(1, True), gradients(2, True), gradients(2, False)
    assert whole.keys() == split.keys()
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-5, msg=name)
    gate = "layers.0.feed_forward.router.gate.weight"
    assert (undivided[gate] - whole[gate]).abs().max() > 1e-3


def test_step_stats_count_each_token_once_even_when_recomputed():
    model = Transformer(moe_args(moe_balance="aux_loss"), seed=0)
    moe = model.layers["0"].feed_forward
    x = torch.randn(2, 4, 32, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # forward runs again in backward
    stats = moe.take_stats()
    assert stats.shape == (4 + STATS,) and stats[:4].sum() == 8 * 2  # 8 tokens x top-2
    assert stats[5] == 1 and stats[7] == 8  # one forward, 8 tokens
    assert moe.take_stats() is None  # taken: reset
    model.eval()
    moe(x)
    assert moe.take_stats() is None  # eval forwards do not count


def test_load_metrics_by_hand():
    # two MoE layers of 4 experts; layer 0 loads 4,2,1,1 (max/mean 2), layer 1 evenly
    table = torch.zeros(2, 4 + STATS)
    table[0, :4] = torch.tensor([4.0, 2.0, 1.0, 1.0])
    table[1, :4] = 2.0
    table[:, 4] = torch.tensor([3.0, 1.0])  # balance-loss sums over 2 forwards each: means 1.5 and 0.5
    table[:, 5] = 2.0
    table[:, 6] = torch.tensor([4.0, 8.0])  # entropy over 4 tokens: 1.0 and 2.0 nats a token
    table[:, 7] = 4.0
    assert moe_metrics(table) == {"moe_load_max_over_mean": 2.0, "moe_tokens_dropped": 0,
                                  "moe_router_entropy": 1.5, "moe_aux_loss": 1.0}
    table[:, 5] = 0.0  # no balance loss (bias / none): not reported
    assert "moe_aux_loss" not in moe_metrics(table)


def test_after_step_moves_the_bias_from_the_step_load_and_resets():
    model = Transformer(moe_args(n_layers=2, moe_bias_rate=0.1), seed=0)
    stats = MoEStats.of([model], model.args)
    model(torch.randint(0, 64, (2, 8)))
    loads = [model.layers[k].feed_forward.step_stats[:4].clone() for k in ("0", "1")]
    figures = stats.after_step(True, torch.device("cpu"))
    for key, load in zip(("0", "1"), loads, strict=True):
        expected = 0.1 * torch.sign(load.mean() - load)
        assert torch.equal(model.layers[key].feed_forward.expert_bias, expected)
    worst = max(float(load.max() / load.mean()) for load in loads)
    assert figures["moe_load_max_over_mean"] == pytest.approx(worst)
    assert model.layers["0"].feed_forward.step_stats is None


def test_compile_of_experts_is_refused_and_auto_trains_eagerly():
    from meshrun.parallel.compile import layout_allows

    with pytest.raises(ConfigError, match=r"^train\.compile must be false with model\.experts=4 "):
        layout_allows(True, 1, False, 1, experts=4)
    assert layout_allows(None, 1, False, 1, experts=4) is False  # 'auto': eager, with a warning
    assert layout_allows(True, 1, False, 1, experts=0) is True


def test_tensor_parallel_of_a_moe_model_resolves_with_and_without_ep():
    """tp splits the attention and dense blocks (the experts stay whole on each tp rank): no refusal."""
    shape = ModelShape.from_args(moe_args())
    assert resolve_layout(ParallelOptions(strategy="fsdp", tp=2), 2, shape).dims.tp == 2
    dims = resolve_layout(ParallelOptions(strategy="fsdp", tp=2, ep=2), 4, shape).dims
    assert (dims.dp_shard, dims.ep, dims.tp) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"^model\.experts=4 is not divisible by parallel\.ep=3"):
        resolve_layout(ParallelOptions(strategy="fsdp", ep=3), 3, shape)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(experts=-1), "model.experts must be an integer >= 0"),
    (dict(experts_per_token=5), "model.experts_per_token must be an integer from 1 to model.experts=4"),
    (dict(moe_every=3), "model.moe_every must be an integer from 1 to model.n_layers=2"),
    (dict(moe_balance="loss"), "model.moe_balance must be one of 'bias', 'aux_loss', 'none'"),
    (dict(moe_aux_coef=-1.0), "model.moe_aux_coef must be a number >= 0"),
])
def test_bad_moe_args(kw, message):
    with pytest.raises(ModelError, match=message):
        moe_args(**kw)


@pytest.mark.parametrize("kw", [dict(), dict(moe_every=2, moe_balance="aux_loss", experts=8, experts_per_token=1,
                                              shared_experts=0)])
def test_activation_estimate_tracks_what_an_moe_saves(kw):
    """meshrun plan's activations for MoE blocks (plan/activations.py) against what autograd holds
    (as tests/unit/test_plan.py does for the dense blocks): measured within 0.4%."""
    from meshrun.parallel.dims import ParallelDims
    from meshrun.plan import estimate
    from meshrun.plan.measure import SavedActivations

    args = ModelArgs(**{**size_spec("tiny-moe"), "max_seq_len": 32, **kw})
    model = Transformer(args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with SavedActivations(lambda: [*model.parameters(), *model.buffers()]) as acts:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    est = estimate(args, ParallelDims(1, 1, 1, 1, world_size=1), batch_size=2, seq_len=32).activations
    assert abs(est - acts.peak) <= 0.01 * acts.peak, (est, acts.peak)


def test_training_settings_a_moe_refuses():
    from meshrun.models.moe import check_training

    check_training(moe_args(), dtype="fp16")  # bias: no balance loss to scale
    with pytest.raises(ConfigError, match=r"^model\.moe_balance='bias' with fault\.mode='torchft': "):
        check_training(moe_args(), dtype="fp32", fault_mode="torchft")
    check_training(moe_args(moe_balance="aux_loss"), dtype="fp32", fault_mode="torchft")
    check_training(ModelArgs(**SMALL), dtype="fp16", fault_mode="torchft")  # dense: nothing


def test_hf_export_of_a_moe_run_is_refused():
    from meshrun.models.to_hf import builtin_plan

    run_config = as_dict(load_config(None, ["model.name=tiny-moe"]))
    with pytest.raises(ConfigError, match=r"^model\.experts=4: .*no Hugging Face layout.*--format safetensors"):
        builtin_plan({"tok_embeddings.weight": ((259, 128), None)}, run_config, {})


def test_bad_moe_keys_are_one_line_and_exit_2_through_the_cli():
    base = ["train", "--set", "model.name=tiny-moe", "--set", "train.run_dir=unused"]
    results = meshrun_each(
        [*base, "--set", "model.experts_per_token=5"],
        [*base, "--set", "model.moe_balance=loss"],
        [*base, "--set", "parallel.strategy=fsdp", "--set", "parallel.ep=3", "--nproc-per-node", "3"],
        [*base, "--set", "model.moe_balance=aux_loss", "--set", "train.dtype=fp16", "--nproc-per-node", "1"],
    )
    expected = ["model.experts_per_token must be an integer from 1 to model.experts=4, got 5",
                "model.moe_balance must be 'bias', 'aux_loss', 'none' or ''",
                "model.experts=4 is not divisible by parallel.ep=3",
                "model.moe_balance='aux_loss' with train.dtype='fp16': the balance loss's gradient bypasses"]
    for result, text in zip(results, expected, strict=True):
        assert result.returncode == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and text in lines[0], result.stderr


def test_forward_under_fake_tensors_splits_evenly():
    """`meshrun plan --simulate` steps the model under FakeTensorMode: no routing values to read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = Transformer(moe_args(), seed=0)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        out = model(mode.from_tensor(torch.zeros(2, 8, dtype=torch.long)))
        out.sum().backward()
    assert tuple(out.shape) == (2, 8, 64)


@pytest.mark.timeout(20)
def test_moe_layer_counts_are_arithmetic_at_any_depth():
    """The counts that `num_params`, the memory preflight and the planner use match `is_moe_layer`
    and `stage_of_block` block by block, and take no time at a depth nobody can build (a fuzzed
    config named ~10**18 layers and the preflight looped over them: the fuzz test never ended)."""
    from meshrun.plan.show import stage_block_ranges, stage_of_block

    for n_layers in range(1, 13):
        for every in range(1, n_layers + 1):
            args = moe_args(n_layers=n_layers, moe_every=every)
            assert args.num_moe_layers == sum(args.is_moe_layer(i) for i in range(n_layers)), (n_layers, every)
            for start in range(n_layers + 1):
                for stop in range(start, n_layers + 1):
                    assert args.moe_layers_between(start, stop) == sum(map(args.is_moe_layer, range(start, stop)))
        for pp in range(1, n_layers + 1):
            ranges = stage_block_ranges(n_layers, pp)
            assert [stage_of_block(i, n_layers, pp) for i in range(n_layers)] == [
                s for s, (start, stop) in enumerate(ranges) for _ in range(start, stop)], (n_layers, pp)
    huge = moe_args(n_layers=10**18, moe_every=3)
    assert huge.num_moe_layers == 10**18 // 3 and huge.num_params() > 10**18
    assert ModelArgs(**{**SMALL, "n_layers": 10**18}).num_moe_layers == 0


def _ops_run(experts, x: torch.Tensor, counts: list[int]) -> set[str]:
    """The aten ops a bf16-autocast forward and backward of `experts` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Record(), torch.autocast("cpu", dtype=torch.bfloat16):
        experts(x, torch.tensor(counts)).float().sum().backward()
    return {name if name.startswith("aten.") else f"aten.{name}" for name in seen}


def _experts_by_loop(experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference: one matmul per expert on its own tokens, in x's dtype."""
    w1, w2, w3 = (w.to(x.dtype) for w in (experts.w1, experts.w2, experts.w3))
    outs = [(F.silu(part @ w1[e].t()) * (part @ w3[e].t())) @ w2[e].t()
            for e, part in enumerate(torch.split(x, counts))]
    return torch.cat(outs)


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 0, 0, 3], [0, 0, 0, 0]], ids=["uneven", "one_expert", "none"])
def test_bf16_experts_use_grouped_gemm_bitwise_as_a_loop_and_fp32_a_loop(counts):
    """bf16 on CPU goes through torch._grouped_mm (fp32 fails in its backward there), with the
    loop's outputs and gradients bit for bit, zeros included; under autocast the same."""
    from meshrun.models.moe import EXPERT_LOOP, GROUPED_GEMM, GroupedExperts, expert_compute

    assert expert_compute("cpu", torch.bfloat16) == GROUPED_GEMM
    assert expert_compute("cpu", torch.float32) == EXPERT_LOOP == expert_compute("cuda", torch.float32)
    torch.manual_seed(0)
    experts = GroupedExperts(16, 24, 4)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.2)
    x = torch.randn(sum(counts), 16)
    grads = []
    for run in ("grouped", "reference"):
        experts.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts(x, torch.tensor(counts)) if run == "grouped" else _experts_by_loop(experts, x.bfloat16(),
                                                                                             counts)
        assert out.dtype == torch.bfloat16
        (out.float() * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        grads.append((out.detach(), [w.grad.clone() if w.grad is not None else torch.zeros_like(w)
                                     for w in experts.parameters()]))
    (got, got_grads), (want, want_grads) = grads
    assert torch.equal(got, want)
    assert ("aten._grouped_mm" in _ops_run(experts, x, counts)) == (sum(counts) > 0)  # none: the loop
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == torch.float32 and torch.equal(g, w)
    with torch.no_grad():  # fp32: the loop, in fp32
        assert experts(x, torch.tensor(counts)).dtype == torch.float32
