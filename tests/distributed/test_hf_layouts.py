"""A Hugging Face model (`model.hf`) trains under every layout like the plain `transformers` model.

Two tiny models saved with save_pretrained: a Llama (4 heads, 2 kv heads) and a Qwen3 with tied
embeddings and per-head q/k norms. One 4-rank launch trains each layout in turn through meshrun's
own path (build_hf_model on the meta device, resolve_layout, build_layout, load_hf_weights from
the safetensors, AdamW, train.step.layout_step and its loss averaging) for STEPS steps on one fixed
global batch; one process does the same without a process group. Against the single-process
`transformers` model (AutoModelForCausalLM.from_pretrained, the same AdamW), the loss every rank
logs must match at every step within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_hf

from meshrun.models.hf import build_hf_model
from meshrun.models.hf_load import load_hf_weights
from meshrun.parallel.layout import build_layout
from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
from meshrun.testing import run_distributed
from meshrun.train.step import layout_mean_loss, layout_step

pytestmark = pytest.mark.timeout(300)

STEPS = 10
GLOBAL_BATCH = 8
SEQ = 16
LR = 3e-3
TOL = 1e-4
CPU = torch.device("cpu")
FAMILIES = ("llama", "qwen3")

# family -> layout name -> ParallelOptions keywords (4 ranks)
LAYOUTS = {
    "llama": {
        "ddp4": dict(strategy="ddp"),
        "fsdp4": dict(strategy="fsdp", dp_shard=4),
        "hsdp2x2": dict(strategy="fsdp", dp_replicate=2, dp_shard=2),
        "fsdp2_tp2_loss_parallel": dict(strategy="fsdp", dp_shard=2, tp=2, loss_parallel=True),
        "pp2_gpipe_dp2": dict(strategy="ddp", pp=2, pp_schedule="gpipe"),
        "pp2_1f1b_fsdp2_ac": dict(strategy="fsdp", dp_shard=2, pp=2, pp_schedule="1f1b",
                                  activation_checkpointing=True),
    },
    "qwen3": {  # tied embeddings: no pipeline (the two ends would hold separate copies)
        "fsdp4": dict(strategy="fsdp", dp_shard=4),
        "tp2_dp2": dict(strategy="fsdp", dp_replicate=2, tp=2),
    },
}


def _global_batch(vocab: int):
    gen = torch.Generator().manual_seed(1000)
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen)


def _train_meshrun(hf_dir: str, options: dict, world_size: int) -> list[float]:
    """meshrun's path, as the trainer takes it; the loss every rank logs, per step."""
    with torch.device("meta"):
        model = build_hf_model(hf_dir, seed=7)
    tp, pp = options.get("tp", 1), options.get("pp", 1)
    dp = world_size // (tp * pp)
    opts = ParallelOptions(**options, batch_size=GLOBAL_BATCH // dp)
    layout = build_layout(model, resolve_layout(opts, world_size, ModelShape.from_model(model)), device=CPU, seed=7)
    load_hf_weights(layout.parts, hf_dir)
    optimizers = [torch.optim.AdamW(part.parameters(), lr=LR, weight_decay=0.0) for part in layout.parts]
    tokens = _global_batch(model.args.vocab_size)
    per = GLOBAL_BATCH // layout.dp_size
    rows = tokens[layout.dp_rank * per:(layout.dp_rank + 1) * per]

    def batches():
        while True:
            yield rows[:, :-1], rows[:, 1:]

    it = batches()
    losses = []
    for _ in range(STEPS):
        loss, _, _ = layout_step(layout, optimizers, it, grad_accum=1, dtype="fp32", grad_clip=0.0, need_grad_norm=False)
        losses.append(layout_mean_loss(layout, loss))
    return losses


def _rank_train_all(dirs: dict[str, str]) -> dict[str, list[float]]:
    import torch.distributed as dist

    return {f"{family}/{name}": _train_meshrun(dirs[family], options, dist.get_world_size())
            for family, layouts in LAYOUTS.items() for name, options in layouts.items()}


def _train_transformers(hf_dir: str) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tokens = _global_batch(model.config.vocab_size)
    losses = []
    for _ in range(STEPS):
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {family: str(save_tiny_hf(root / family, family)) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(hf_dirs) -> dict[str, list[float]]:
    return {family: _train_transformers(path) for family, path in hf_dirs.items()}


@pytest.fixture(scope="module")
def runs(hf_dirs) -> list[dict[str, list[float]]]:
    return run_distributed(_rank_train_all, world_size=4, args=(hf_dirs,), timeout=240,
                           env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_matches_transformers(hf_dirs, references, family):
    ref = references[family]
    assert ref[-1] < ref[0] - 0.5, f"the reference should learn: {ref}"
    got = _train_meshrun(hf_dirs[family], {"strategy": "ddp"}, 1)
    diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
    assert diff < TOL, f"{family}: one process differs by {diff:.2e}: {got} vs {ref}"


@pytest.mark.parametrize("key", [f"{f}/{n}" for f, layouts in LAYOUTS.items() for n in layouts])
def test_layout_matches_transformers(runs, references, key):
    ref = references[key.split("/")[0]]
    for rank, result in enumerate(runs):
        diff = max(abs(a - b) for a, b in zip(result[key], ref, strict=True))
        if rank == 0:
            print(f"{key}: max loss difference {diff:.1e}")
        assert diff < TOL, f"{key} rank {rank}: loss differs by {diff:.2e}: {result[key]} vs {ref}"
