"""LoRA through peft on 2 real gloo ranks trains like a plain peft model in one process.

The built-in model is built on the meta device, given peft's LoRA layers (models/lora.py), then
laid out as DDP 2 and FSDP 2 (frozen and LoRA parameters in one fully_shard unit per block),
materialised and its adapters filled. Each layout runs meshrun's own optimizer (AdamW over the
trainable parameters only) and `layout_step` for 10 steps; the adapters must then equal, within
1e-4, those of `peft.get_peft_model` on an eagerly built copy trained by a plain torch loop on
the same global batches. The base must not move, and with train.dtype bf16 under FSDP the base is
stored in bf16 while the adapters stay fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshrun.config.lora_section import LoraSection
from meshrun.config.sections import OptimSection
from meshrun.errors import ConfigError
from meshrun.models.llama import ModelArgs, Transformer
from meshrun.models.lora import apply_lora, base_fingerprint, init_adapters
from meshrun.models.meta import on_meta
from meshrun.parallel.dims import ParallelDims
from meshrun.parallel.layout import BuiltLayout, materialize
from meshrun.parallel.parallelize import parallelize_nd
from meshrun.testing import run_distributed
from meshrun.train.optimizers import build_optimizer
from meshrun.train.step import layout_mean_loss, layout_step

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(90)

STEPS = 10
GLOBAL_BATCH = 4
SEQ = 16
SEED = 3
TOL = 1e-4
CPU = torch.device("cpu")
LORA = LoraSection(rank=4, alpha=8.0)
OPTIM = OptimSection(lr=1e-2, warmup_steps=0, schedule="constant")
LAYOUTS = {"ddp2": dict(dp_replicate=2), "fsdp2": dict(dp_shard=2)}


def _args() -> ModelArgs:
    return ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=SEQ)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batch every step (random tokens), so that 10 steps visibly learn it."""
    tokens = torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(11))
    return [(tokens[:, :-1], tokens[:, 1:])] * STEPS


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full adapter tensors by meshrun's names (a sharded one gathered: every rank calls this)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[name.removeprefix("module.").removeprefix("base_model.model.").replace(".default", "")] = \
                full.detach().clone()
    return out


def _train(degrees: dict, dtype: str = "fp32") -> dict:
    world = dist.get_world_size()
    dims = ParallelDims(**{"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **degrees}, world_size=world)
    mesh = dims.build_mesh("cpu")
    with on_meta():
        model = Transformer(_args(), seed=SEED)
    model = apply_lora(model, LORA, base_dtype=torch.bfloat16 if dtype == "bf16" else None)
    param_dtype = torch.bfloat16 if dtype == "bf16" and dims.fsdp_enabled else None
    part = parallelize_nd(model, dims, mesh, device=CPU, param_dtype=param_dtype,
                          materialize=lambda m: materialize(m, CPU, SEED))
    init_adapters([part], SEED)
    layout = BuiltLayout([part], dp_rank=dims.dp_rank(mesh), dp_size=dims.dp_size, device=CPU,
                         world_size=world, dims=dims, mesh=mesh)
    optimizer = build_optimizer(part, OPTIM)
    held = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    fingerprint = base_fingerprint([part])
    per_rank = GLOBAL_BATCH // layout.dp_size
    rows = slice(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)
    losses = []
    for inputs, targets in _batches():
        loss, _, _ = layout_step(layout, [optimizer], iter([(inputs[rows], targets[rows])]), grad_accum=1,
                                 dtype=dtype, grad_clip=0.0)
        losses.append(layout_mean_loss(layout, loss))
    dtypes = {("adapter" if p.requires_grad else "base", p.dtype) for p in part.parameters()}
    return {"adapters": _adapters(part), "losses": losses, "held": held, "dtypes": dtypes,
            "fingerprint": fingerprint, "fingerprint_after": base_fingerprint([part])}


def _rank_layouts() -> dict:
    out = {name: _train(degrees) for name, degrees in LAYOUTS.items()}
    out["fsdp2_bf16"] = _train(LAYOUTS["fsdp2"], "bf16")
    return out


def _reference() -> dict:
    """peft's own model in one process: get_peft_model on an eager copy, a plain torch loop."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraConfig

    meshrun_init = apply_lora(Transformer(_args(), seed=SEED), LORA)
    init_adapters([meshrun_init], SEED)  # the same starting adapters as every layout
    start = {name: p.detach().clone() for name, p in meshrun_init.named_parameters() if p.requires_grad}
    config = LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0, target_modules=list(LORA.target_names))
    model = get_peft_model(Transformer(_args(), seed=SEED), config)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(start[name.removeprefix("base_model.model.")])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps,
                                  weight_decay=OPTIM.weight_decay)
    losses = []
    for inputs, targets in _batches():
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    moved = any(not torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)
    return {"adapters": _adapters(model), "losses": losses, "held": sum(p.numel() for p in trainable),
            "base_moved": moved}


def test_lora_ddp2_fsdp2_match_a_peft_model_in_one_process():
    ranks = run_distributed(_rank_layouts, world_size=2, timeout=75)
    ref = _reference()
    assert not ref["base_moved"] and ref["losses"][-1] < ref["losses"][0] - 0.05, "the reference did not learn"
    moved = max((ref["adapters"][k] - v).abs().max().item() for k, v in
                _reference_start().items() if ".lora_B." in k)
    assert moved > 100 * TOL, "the adapters barely moved: the comparison would not bite"
    for name in LAYOUTS:
        for rank, got in enumerate(ranks):
            res = got[name]
            assert res["held"] == ref["held"], f"{name}: the optimizer must hold the adapters only"
            assert set(res["adapters"]) == set(ref["adapters"])
            worst = max((res["adapters"][k] - ref["adapters"][k]).abs().max().item() for k in ref["adapters"])
            assert worst <= TOL, f"{name} rank {rank}: adapters differ from peft's by {worst:.2e}"
            assert res["losses"] == pytest.approx(ref["losses"], abs=TOL), f"{name} rank {rank}"
            assert res["fingerprint"] == res["fingerprint_after"], f"{name}: the frozen base changed"
            assert res["fingerprint"] == ranks[0]["ddp2"]["fingerprint"], "the fingerprint depends on the layout"
    bf16 = ranks[0]["fsdp2_bf16"]
    assert bf16["dtypes"] == {("base", torch.bfloat16), ("adapter", torch.float32)}
    assert bf16["fingerprint"] != ranks[0]["fsdp2"]["fingerprint"]  # a bf16 base is another base
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.05 and bf16["fingerprint"] == bf16["fingerprint_after"]


def _reference_start() -> dict[str, torch.Tensor]:
    model = apply_lora(Transformer(_args(), seed=SEED), LORA)
    init_adapters([model], SEED)
    return _adapters(model)


def test_targets_that_match_nothing_name_the_key_and_the_layers():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError) as err:
        apply_lora(model, LoraSection(rank=2, targets="wq"))
    assert str(err.value).startswith("lora.targets='wq' matches no layer peft can adapt")
    assert "linear layers are named 0" in str(err.value) and "\n" not in str(err.value)
