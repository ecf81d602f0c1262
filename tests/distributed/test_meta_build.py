"""A model built on the meta device, sharded, then materialised has the eager build's weights, bit for bit.

The trainer builds with `build_meta_model` and lets `build_layout` split, shard and materialise
(`to_empty` + `init_weights(seed)`) only this rank's share. Here each layout's full state dict
(gathered from every rank's shards and stages) must equal a plain `Transformer(args, seed)`
built eagerly in one process, tensor for tensor with `torch.equal`, and every part's RoPE tables
must equal the eager ones (they are non-persistent buffers, so the state dict leaves them out).
The same layout built from the eager model (a user factory without `init_weights`) must agree too,
and full weights loaded afterwards (`model.init_from`) must land in every rank's shards.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshrun.config.sections import ParallelSection, TrainSection
from meshrun.models.factory import build_meta_model
from meshrun.models.llama import ModelArgs, Transformer
from meshrun.parallel.layout import build_layout, is_meta
from meshrun.parallel.parallelize import unwrap_model
from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
from meshrun.testing import run_distributed

pytestmark = pytest.mark.timeout(240)

SEED = 1234
MODEL = dict(name="tiny", factory="", dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64,
             max_seq_len=16, ffn_hidden=0, tie_embeddings=False, rope_theta=0, norm_eps=0, init_from="")
ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=16)
TRAIN = TrainSection(batch_size=4, seed=SEED)

LAYOUTS_2 = {
    "ddp2": ParallelSection(),
    "fsdp2": ParallelSection(strategy="fsdp", dp_shard=2),
    "fsdp2_ac": ParallelSection(strategy="fsdp", dp_shard=2),  # with activation checkpointing
    "tp2": ParallelSection(strategy="fsdp", dp_replicate=1, dp_shard=1, tp=2),
    "pp2": ParallelSection(pp=2, pp_schedule="1f1b"),
    "pp2_interleaved": ParallelSection(pp=2, pp_schedule="interleaved_1f1b"),  # 2 stages per rank
}


class _Cfg:
    """The `[model]` attributes build_meta_model reads."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _eager() -> Transformer:
    return Transformer(ARGS, seed=SEED)


def _rope(parts: list[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(unwrap_model(p).freqs_cos.clone(), unwrap_model(p).freqs_sin.clone()) for p in parts]


def _build_all(world_size: int) -> dict[str, dict]:
    """On every rank: each layout built from a meta model and from an eager one, gathered in full."""
    out = {}
    layouts = LAYOUTS_2 if world_size > 1 else {"single": ParallelSection()}
    for name, pcfg in layouts.items():
        train = TrainSection(batch_size=4, seed=SEED, activation_checkpointing=name.endswith("_ac"))
        model = build_meta_model(_Cfg(**MODEL), 64, seed=SEED)
        assert is_meta(model), "the built-in model must build on the meta device"
        resolved = resolve_layout(ParallelOptions.from_sections(pcfg, train), world_size,
                                  ModelShape.from_model(model))
        layout = build_layout(model, resolved, device=torch.device("cpu"), seed=SEED)
        assert not any(is_meta(part) for part in layout.parts)
        eager = build_layout(_eager(), resolved, device=torch.device("cpu"), seed=SEED)
        meta_state = layout.full_state_dict()
        layout.load_full_state_dict(Transformer(ARGS, seed=SEED + 1).state_dict())  # model.init_from
        out[name] = {"meta": meta_state, "eager": eager.full_state_dict(), "loaded": layout.full_state_dict(),
                     "rope": _rope(layout.parts),
                     "local_numel": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                        for part in layout.parts for p in part.parameters())}
    if world_size > 1:  # a tied output projection stays tied through the meta build, sharded or not
        out["tied"] = {}
        for name in ("ddp2", "fsdp2"):
            model = build_meta_model(_Cfg(**{**MODEL, "tie_embeddings": True}), 64, seed=SEED)
            resolved = resolve_layout(ParallelOptions.from_sections(LAYOUTS_2[name], TRAIN), world_size,
                                      ModelShape.from_model(model))
            inner = unwrap_model(build_layout(model, resolved, device=torch.device("cpu"), seed=SEED).parts[0])
            out["tied"][name] = inner.output.weight is inner.tok_embeddings.weight
    return out


def _check(result: dict, rank: int, name: str) -> None:
    reference = _eager().state_dict()
    rope = (reference.pop("freqs_cos", None), reference.pop("freqs_sin", None))
    want_rope = (_eager().freqs_cos, _eager().freqs_sin)
    assert rope == (None, None), "RoPE tables are non-persistent"
    for cos, sin in result["rope"]:
        assert torch.equal(cos, want_rope[0]) and torch.equal(sin, want_rope[1]), f"{name}: RoPE differs"
    if rank != 0:
        assert result["meta"] == {} and result["eager"] == {} and result["loaded"] == {}
        return
    for kind in ("meta", "eager", "loaded"):
        got = result[kind]
        if kind == "loaded":  # init_from's weights, loaded into this rank's shards after materialising
            reference = Transformer(ARGS, seed=SEED + 1).state_dict()
        assert sorted(got) == sorted(reference), f"{name} {kind}: names differ"
        differ = [k for k in reference if not torch.equal(got[k], reference[k])]
        assert not differ, f"{name} {kind}: {differ} differ from what was expected"


def test_meta_build_equals_eager_build_in_one_process():
    result = _build_all(1)["single"]
    _check(result, 0, "single")
    assert result["local_numel"] == ARGS.num_params()


def test_meta_build_equals_eager_build_on_two_ranks():
    results = run_distributed(_build_all, world_size=2, args=(2,), timeout=200, env={"OMP_NUM_THREADS": "1"})
    total = ARGS.num_params()
    for rank, result in enumerate(results):
        for name in LAYOUTS_2:
            _check(result[name], rank, name)
        assert result["tied"] == {"ddp2": True, "fsdp2": True}, result["tied"]
        # what a rank holds: sharded and split layouts hold a part, replicated ones the whole
        assert result["ddp2"]["local_numel"] == total
        for name in ("fsdp2", "fsdp2_ac", "tp2", "pp2", "pp2_interleaved"):
            assert result[name]["local_numel"] < 0.75 * total, (name, result[name]["local_numel"], total)
