"""The step loop's pieces in one process: LR schedule, accumulation, activation checkpointing."""

from __future__ import annotations

import itertools

import pytest
import torch

from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.checkpointing import apply_activation_checkpointing
from meshrun.train.schedules import lr_factor
from meshrun.train.step import lm_loss, train_step


def _model(seed=0):
    return Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16),
                       seed=seed)


def _batch(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (n, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def test_warmup_then_cosine_to_min():
    kw = dict(total_steps=101, warmup_steps=10, schedule="cosine", min_ratio=0.1)  # step 100 is the last
    assert lr_factor(0, **kw) == pytest.approx(0.1)
    assert lr_factor(9, **kw) == pytest.approx(1.0)
    assert lr_factor(100, **kw) == pytest.approx(0.1)
    assert lr_factor(55, **kw) == pytest.approx(0.55)
    assert lr_factor(50, total_steps=100, warmup_steps=0, schedule="constant", min_ratio=0.0) == 1.0


def test_activation_checkpointing_gives_the_same_gradients():
    plain, wrapped = _model(), _model()
    assert apply_activation_checkpointing(wrapped) == 2
    x, y = _batch()
    for model in (plain, wrapped):
        lm_loss(model, x, y).backward()
    grads = dict(plain.named_parameters())
    for name, param in wrapped.named_parameters():
        clean = name.replace("._checkpoint_wrapped_module", "")
        assert torch.allclose(param.grad, grads[clean].grad, atol=1e-6), name


def test_two_micro_batches_equal_one_double_batch():
    a, b = _model(), _model()
    x, y = _batch(n=8)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b))
    halves = iter([(x[:4], y[:4]), (x[4:], y[4:])])
    loss_a, _, _ = train_step(a, opt_a, halves, grad_accum=2, device=torch.device("cpu"), dtype="fp32", grad_clip=0)
    loss_b, _, _ = train_step(b, opt_b, itertools.repeat((x, y)), grad_accum=1, device=torch.device("cpu"),
                              dtype="fp32", grad_clip=0)
    assert loss_a.item() == pytest.approx(loss_b.item(), abs=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_grad_norm_is_skipped_only_when_it_neither_clips_nor_logs():
    cpu = torch.device("cpu")
    a, b = _model(), _model()
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b))
    batch = itertools.repeat(_batch())
    _, norm_a, _ = train_step(a, opt_a, batch, grad_accum=1, device=cpu, dtype="fp32", grad_clip=0)
    _, norm_b, _ = train_step(b, opt_b, batch, grad_accum=1, device=cpu, dtype="fp32", grad_clip=0,
                              need_grad_norm=False)
    assert norm_a.item() > 0 and torch.isnan(norm_b)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)  # skipping the norm changes nothing else
    _, clipped, _ = train_step(b, opt_b, batch, grad_accum=1, device=cpu, dtype="fp32", grad_clip=1.0,
                               need_grad_norm=False)
    assert not torch.isnan(clipped)  # clipping needs the norm anyway


def test_built_layout_steps_a_meta_built_model_like_the_eager_one():
    """One process: build_layout materialises a meta model with the eager build's weights, and
    layout_step / layout_evaluate on it are train_step / evaluate on the eager model."""
    from meshrun.config.sections import ParallelSection, TrainSection
    from meshrun.parallel.layout import build_layout, is_meta
    from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
    from meshrun.train.step import evaluate, layout_evaluate, layout_step

    cpu = torch.device("cpu")
    with torch.device("meta"):
        meta = _model(seed=3)
    assert is_meta(meta)
    resolved = resolve_layout(ParallelOptions.from_sections(ParallelSection(), TrainSection()), 1,
                              ModelShape.from_model(meta))
    layout = build_layout(meta, resolved, device=cpu, seed=3)
    eager = _model(seed=3)
    assert not is_meta(layout.parts[0])
    opt_l, opt_e = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (layout.parts[0], eager))
    batch = itertools.repeat(_batch())
    for _ in range(2):
        got, _, _ = layout_step(layout, [opt_l], batch, grad_accum=1, dtype="fp32", grad_clip=1.0)
        want, _, _ = train_step(eager, opt_e, batch, grad_accum=1, device=cpu, dtype="fp32", grad_clip=1.0)
        assert torch.equal(got, want)
    assert layout_evaluate(layout, [_batch(1)], steps=1, dtype="fp32") == evaluate(
        eager, [_batch(1)], steps=1, device=cpu, dtype="fp32").item()
