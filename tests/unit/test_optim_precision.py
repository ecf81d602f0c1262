"""Optimizers, schedules and the fp16 scaler in one process: curves, groups, kernels, state round trips.

The distributed side (every layout, resume in fresh processes, reshard) is
tests/distributed/test_precision_optim.py.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from meshrun.checkpoint.state import inner_optimizers
from meshrun.config import OptimSection, load_config
from meshrun.errors import ConfigError
from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.rules import check_optimizer_shards
from meshrun.train.optimizers import (
    MuonWithAdamW,
    build_optimizer,
    implementation_kwargs,
    muon_params,
)
from meshrun.train.precision import build_loss_scaler
from meshrun.train.schedules import build_scheduler, lr_factor
from meshrun.train.step import train_step

CPU = torch.device("cpu")


def _model(seed: int = 0) -> Transformer:
    return Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                                 tie_embeddings=False), seed=seed)


def _batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 64, (4, 16), generator=g)
        yield x, torch.roll(x, -1, dims=1)


def _cfg(**kw) -> OptimSection:
    cfg = dataclasses.replace(OptimSection(), **kw)
    cfg.validate()
    return cfg


@pytest.mark.parametrize(("schedule", "points"), [
    # (step, factor) with 101 steps (0-100: the last step, 100, is at min_lr), 10 of warmup, min_ratio 0.1
    ("cosine", [(0, 0.1), (9, 1.0), (55, 0.55), (100, 0.1), (101, 0.1)]),
    ("linear", [(0, 0.1), (10, 1.0), (55, 0.55), (99, 0.11), (100, 0.1)]),
    ("constant", [(0, 0.1), (10, 1.0), (100, 1.0)]),
    # wsd, decay_fraction 0.2 of the 91 steps after warmup = 18: flat until step 82, then linear
    ("wsd", [(0, 0.1), (10, 1.0), (81, 1.0), (82, 1.0), (91, 0.55), (99, 0.15), (100, 0.1)]),
])
def test_schedule_curves(schedule, points):
    for step, expected in points:
        got = lr_factor(step, total_steps=101, warmup_steps=10, schedule=schedule, min_ratio=0.1,
                        decay_fraction=0.2)
        assert got == pytest.approx(expected), (schedule, step)


def test_wsd_scheduler_sets_the_lr_of_every_group():
    model = _model()
    opt = build_optimizer(model, _cfg(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="wsd", decay_fraction=0.5))
    sched = build_scheduler(opt, _cfg(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="wsd", decay_fraction=0.5), 10)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        assert {g["lr"] for g in opt.param_groups} == {seen[-1]}
        opt.step()
        sched.step()
    assert seen == pytest.approx([1.0] * 5 + [0.8, 0.6, 0.4, 0.2, 0.0])  # the last step at min_lr


def test_weight_decay_on_matrices_and_embeddings_not_on_gains():
    model = _model()
    opt = build_optimizer(model, _cfg(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if not g["weight_decay"] for p in g["params"]}
    assert "tok_embeddings.weight" in decayed and "output.weight" in decayed
    assert "layers.0.attention.wq.weight" in decayed
    assert plain == {n for n in names.values() if n.endswith("norm.weight")}  # RMSNorm gains (no biases)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = _model()
    hidden = {n for n, p in model.named_parameters() if p in muon_params(model)}
    assert hidden == {n for n, p in model.named_parameters()
                      if p.dim() == 2 and n not in ("tok_embeddings.weight", "output.weight")}
    opt = build_optimizer(model, _cfg(name="muon"))
    assert isinstance(opt, MuonWithAdamW)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert len(opt.param_groups) == len(muon.param_groups) + len(adamw.param_groups)


def test_auto_picks_fused_where_torch_has_it_else_torchs_default():
    params = list(_model().parameters())
    assert implementation_kwargs("adamw", "auto", params) == {"fused": True}
    assert implementation_kwargs("sgd", "auto", params) == {"fused": True}
    assert implementation_kwargs("adafactor", "auto", params) == {}  # torch's default: for-loop on CPU
    assert implementation_kwargs("adam", "for-loop", params) == {"foreach": False}
    assert implementation_kwargs("adam", "foreach", params) == {"foreach": True}


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "adafactor", "muon"])
def test_every_optimizer_trains(name):
    model = _model()
    cfg = _cfg(name=name, lr={"sgd": 0.05, "adafactor": 0.03}.get(name, 3e-3), nesterov=name == "sgd")
    opt = build_optimizer(model, cfg)
    losses = [float(train_step(model, opt, iter([batch]), grad_accum=1, device=CPU, dtype="fp32", grad_clip=1.0)[0])
              for batch in [next(_batches(1))] * 8]  # the same batch: the loss must fall
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize(("override", "message"), [
    (dict(name="lion"), "optim.name must be one of 'adamw', 'adam', 'sgd', 'adafactor', 'muon', got 'lion'"),
    (dict(name="adafactor", implementation="fused"), "optim.implementation must be 'auto' or 'for-loop' with optim.name = 'adafactor'"),
    (dict(name="muon", implementation="fused"), None),  # its AdamW half is fused
    (dict(nesterov=True, momentum=0.0), "optim.nesterov must be false when optim.momentum = 0"),
    (dict(schedule="wsd", decay_fraction=0.0), "optim.decay_fraction must be in (0, 1], got 0.0"),
    (dict(implementation="jit"), "optim.implementation must be one of 'auto', 'fused', 'foreach', 'for-loop'"),
])
def test_optim_keys_are_checked(override, message):
    if message is None:
        _cfg(**override)
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        _cfg(**override)


def test_optimizers_that_cannot_update_dtensor_shards_are_refused():
    with pytest.raises(ConfigError, match="optim.name='adafactor' cannot update FSDP/TP parameter shards"):
        check_optimizer_shards("adafactor", "auto")
    with pytest.raises(ConfigError, match="optim.name='sgd' with optim.implementation='fused' cannot"):
        check_optimizer_shards("sgd", "fused")
    check_optimizer_shards("sgd", "auto")  # auto leaves DTensors to torch's default kernel
    check_optimizer_shards("muon", "auto")
    with pytest.raises(ConfigError, match="optim.name='adafactor' cannot update"):  # at config time
        load_config(None, ["optim.name=adafactor", "parallel.strategy=fsdp"])
    load_config(None, ["optim.name=adafactor", "parallel.strategy=fsdp", "parallel.dp_replicate=2"])  # no shards


def test_muon_state_round_trip_continues_exactly():
    """Saved and loaded through DCP's flattened dict (as checkpoints do), a fresh Muon + AdamW pair,
    and its LR scheduler, must step on exactly like the original. (An inner load_state_dict
    replaces its param groups; the pair must then schedule those, not the old ones.)"""
    cfg, options = _cfg(name="muon", warmup_steps=2), StateDictOptions(flatten_optimizer_state_dict=True)
    model = _model()
    opt, batches = build_optimizer(model, cfg), list(_batches(7))
    sched = build_scheduler(opt, cfg, 7)

    def step(m, o, s, batch):
        train_step(m, o, iter([batch]), grad_accum=1, device=CPU, dtype="fp32", grad_clip=1.0)
        s.step()

    for batch in batches[:3]:
        step(model, opt, sched, batch)
    saved = copy.deepcopy(get_optimizer_state_dict(model, inner_optimizers(opt), options=options))
    copy_model = copy.deepcopy(model)
    copy_opt = build_optimizer(copy_model, cfg)
    copy_sched = build_scheduler(copy_opt, cfg, 7)
    set_optimizer_state_dict(copy_model, inner_optimizers(copy_opt), saved, options=options)
    copy_sched.load_state_dict(sched.state_dict())
    for batch in batches[3:]:
        step(model, opt, sched, batch)
        step(copy_model, copy_opt, copy_sched, batch)
    for (name, a), b in zip(model.named_parameters(), copy_model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_fp16_overflow_skips_the_step_and_the_scaler_state_round_trips():
    model = _model()
    opt = build_optimizer(model, _cfg())
    scaler = build_loss_scaler("fp16", [model], CPU, init_scale=1e30)
    assert build_loss_scaler("bf16", [model], CPU, init_scale=1e30) is None
    before = copy.deepcopy(model.state_dict())
    train_step(model, opt, _batches(1), grad_accum=1, device=CPU, dtype="fp16", grad_clip=1.0, scaler=scaler)
    assert scaler.skipped_steps == 1 and scaler.scaler.get_scale() == pytest.approx(5e29)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a skipped step changed weights"
    again = build_loss_scaler("fp16", [model], CPU, init_scale=65536.0)
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == scaler.state_dict()
    fine = build_loss_scaler("fp16", [model], CPU, init_scale=2.0 ** 10)
    train_step(model, opt, _batches(1), grad_accum=1, device=CPU, dtype="fp16", grad_clip=1.0, scaler=fine)
    assert fine.skipped_steps == 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
