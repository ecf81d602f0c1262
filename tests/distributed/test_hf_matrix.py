"""Any Hugging Face causal LM under every layout its structure allows: the architecture x layout matrix.

Twelve tiny random models (tests/hf_zoo.py: Llama, Mistral, Qwen2 with biases, Qwen3, Gemma 3, Phi-3,
GPT-NeoX, GPT-2, OLMo 2, Mixtral, Qwen2-MoE, OPT), saved with save_pretrained, no hub. One 2-rank launch
trains each under DDP, FSDP, TP 2 (tp = the world: norms stay plain beside DTensor biases), PP 2
(1F1B) and CP 2 (context parallel: the sequence split, attention as a ring) through meshrun's own path (build_hf_model on meta, the pre-launch `check_layout`,
build_layout, load_hf_weights, meshrun's optimizer with the default fused AdamW, layout_step) for
STEPS steps on one fixed global batch; one 4-rank launch trains one 2-D composition of each (FSDP 2 x
TP 2, or HSDP 2 x 2 where TP is refused) and two more for the Llama family (FSDP x TP with loss
parallel, PP with GPipe x FSDP with activation checkpointing, and CP 4, CP 2 x FSDP 2, CP 2 x TP 2,
CP 2 x PP 2). Against single-process
transformers (AutoModelForCausalLM.from_pretrained, torch's AdamW), the loss every rank logs must
match at every step within TOL; a layout the structure does not allow must be refused before launch
in one line (CP: an attention the ring does not compute, a sliding window), and the fix it names
must make the run start: for a tied head under PP,
model.tie_embeddings=false, checked against transformers with the head untied the same way.

Export: after FSDP 2 and TP 2, the ranks save the model state with torch.distributed.checkpoint as a
meshrun checkpoint holds it (sharded), `ckpt export --format hf`'s writer turns that checkpoint into
a Hugging Face directory (trained/export_hf.py `write_hf`, tensors assembled from the shards), and
from_pretrained loads it: its logits equal the trained model's within 1e-5.

The matrix goes to docs/models.md (between the markers below), generated from the results:
MESHRUN_WRITE_MODELS_TABLE=1 rewrites it; otherwise the page must already say what the run found.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import hf_zoo
import pytest
import torch

from meshrun.errors import ConfigError
from meshrun.testing import run_distributed

pytestmark = pytest.mark.timeout(600)

STEPS = 10
GLOBAL_BATCH = 8
SEQ = 16
LR = 3e-3
TOL = 1e-4
LOGITS_TOL = 1e-5
ARCHS = list(hf_zoo.ARCHS)
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
BEGIN, END = "<!-- hf-matrix: begin (tests/distributed/test_hf_matrix.py) -->", "<!-- hf-matrix: end -->"

# layout name -> ParallelOptions keywords
LAYOUTS_2 = {
    "ddp": dict(strategy="ddp"),
    "fsdp": dict(strategy="fsdp", dp_shard=2),
    "tp2": dict(strategy="fsdp", dp_replicate=1, dp_shard=1, tp=2),
    "pp2": dict(strategy="ddp", pp=2, pp_schedule="1f1b"),
    "cp2": dict(strategy="fsdp", dp_replicate=1, dp_shard=1, cp=2),
}
TWO_D = {"fsdp2_tp2": dict(strategy="fsdp", dp_shard=2, tp=2),
         "hsdp2x2": dict(strategy="fsdp", dp_replicate=2, dp_shard=2)}
LLAMA_4 = {  # the compositions beyond the matrix the Llama family was proven under (4 ranks); HSDP is
    # GPT-2's and OPT's 2-D column, PP x DDP is PP 2 x the DDP column
    "fsdp2_tp2_loss_parallel": dict(strategy="fsdp", dp_shard=2, tp=2, loss_parallel=True),
    "pp2_gpipe_fsdp2_ac": dict(strategy="fsdp", dp_shard=2, pp=2, pp_schedule="gpipe", activation_checkpointing=True),
    # context parallel with each other dimension (the cp2 column is the 2-rank one)
    "cp4": dict(strategy="fsdp", dp_replicate=1, dp_shard=1, cp=4),
    "cp2_fsdp2": dict(strategy="fsdp", dp_replicate=1, dp_shard=2, cp=2),
    "cp2_tp2": dict(strategy="fsdp", dp_replicate=1, dp_shard=1, cp=2, tp=2),
    "cp2_pp2": dict(strategy="fsdp", dp_replicate=1, dp_shard=1, cp=2, pp=2, pp_schedule="1f1b"),
}
EXPORTED = ("fsdp", "tp2")


def _global_batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000)
    return torch.randint(0, hf_zoo.VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)


def _optim_cfg():
    from types import SimpleNamespace

    return SimpleNamespace(name="adamw", lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                           implementation="auto")  # fused AdamW on the CPU, as a run gets it


def _train(hf_dir: str, options: dict, world: int, *, tie: bool | None = None, export_to: str = "") -> dict:
    """meshrun's path, as the trainer takes it. {"losses": [...]} or {"refused": line}."""

    from meshrun.models.hf import build_hf_model
    from meshrun.models.hf_config import check_hf_context_parallel
    from meshrun.models.hf_load import load_hf_weights
    from meshrun.models.meta import on_meta
    from meshrun.parallel.layout import build_layout
    from meshrun.parallel.resolve import ModelShape, ParallelOptions, resolve_layout
    from meshrun.train.optimizers import build_optimizer
    from meshrun.train.step import layout_mean_loss, layout_step

    with on_meta():
        model = build_hf_model(hf_dir, seed=7, tie_embeddings=tie)
    tp, pp, cp = options.get("tp", 1), options.get("pp", 1), options.get("cp", 1)
    dp = world // (tp * pp * cp)
    try:
        resolved = resolve_layout(ParallelOptions(**options, batch_size=GLOBAL_BATCH // dp), world,
                                  ModelShape.from_model(model))
        model.check_layout(tp, pp)  # what `meshrun train` checks before launch
        check_hf_context_parallel(hf_dir, cp)
    except ConfigError as exc:
        return {"refused": str(exc)}
    layout = build_layout(model, resolved, device=torch.device("cpu"), seed=7)
    load_hf_weights(layout.parts, hf_dir)
    optimizers = [build_optimizer(part, _optim_cfg()) for part in layout.parts]
    tokens = _global_batch()
    per = GLOBAL_BATCH // layout.dp_size
    rows = tokens[layout.dp_rank * per:(layout.dp_rank + 1) * per]

    def batches():
        while True:
            yield rows[:, :-1], rows[:, 1:]

    it = batches()
    losses = []
    for _ in range(STEPS):
        loss, _, _ = layout_step(layout, optimizers, it, grad_accum=1, dtype="fp32", grad_clip=0.0,
                                 need_grad_norm=False)
        losses.append(layout_mean_loss(layout, loss))
    result: dict = {"losses": losses}
    if options.get("ep", 1) > 1:  # what each rank holds of the routed experts, and what it sent
        from meshrun.parallel.expert_parallel import expert_modules

        experts = [m for part in layout.parts for m in expert_modules(part)]
        result["expert_rows"] = sorted({p.to_local().shape[0] for m in experts for p in m.parameters()})
        result["rows_sent"] = sum(m.ep_style.rows_bytes for m in experts)
    if export_to:
        result["logits"] = _export(layout.parts[0], hf_dir, export_to, tokens[:2, :-1], tie)
    return result


def _export(part, hf_dir: str, out: str, sample: torch.Tensor, tie: bool | None) -> list | None:
    """This layout's checkpoint of the trained weights: the model state dict as a meshrun checkpoint
    holds it (`model.<name>`, FSDP/TP shards as DTensors), saved by torch.distributed.checkpoint into
    `out`/ckpt; returns the trained model's logits on `sample` (every rank computes them: a
    collective under FSDP/TP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(part)}, checkpoint_id=os.path.join(out, "ckpt"))
    with torch.no_grad():
        logits = part(sample)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return logits.tolist()


def _export_hf(ckpt: str, hf_dir: str, out: str) -> None:
    """`ckpt export --format hf`'s writer (trained/export_hf.py `write_hf`) over the checkpoint's
    tensors, each assembled from every rank's shards (checkpoint/export.py), as the CLI reads them."""
    from meshrun.checkpoint.export import read_model_tensor, saved_tensors
    from meshrun.trained.export_hf import write_hf
    from meshrun.trained.model_source import ModelSource

    metas = {key[len("model."):]: md for key, md in saved_tensors(Path(ckpt)).items() if key.startswith("model.")}
    specs = {name: (tuple(md.size), md.properties.dtype) for name, md in metas.items()}
    source = ModelSource(Path(ckpt), {"model": {"hf": hf_dir}}, None, specs,
                         lambda name: read_model_tensor(Path(ckpt), name, metas[name]))
    write_hf(source, Path(out), max_bytes=10**9)


def _rank_all(dirs: dict[str, str], exports: str) -> dict[str, dict]:
    import torch.distributed as dist

    world = dist.get_world_size()
    out: dict[str, dict] = {}
    for arch in ARCHS:
        layouts = LAYOUTS_2 if world == 2 else {**({k: v for k, v in LLAMA_4.items()} if arch == "llama" else {}),
                                                "2d": TWO_D["fsdp2_tp2"]}
        for name, options in layouts.items():
            export_to = os.path.join(exports, f"{arch}-{name}") if world == 2 and name in EXPORTED else ""
            got = _train(dirs[arch], options, world, export_to=export_to)
            if "refused" in got and name == "2d":  # no TP for this structure: the other 2-D composition
                got = {**_train(dirs[arch], TWO_D["hsdp2x2"], world), "as": "hsdp2x2", "tp_refused": got["refused"]}
            elif "refused" in got and name == "pp2" and "model.tie_embeddings=false" in got["refused"]:
                got = {**got, "fixed": _train(dirs[arch], options, world, tie=False)}
            out[f"{arch}/{name}"] = got
    return out


def _reference(hf_dir: str, *, untie: bool = False) -> list[float]:
    """Single-process transformers, torch's AdamW (hf_zoo.reference_losses) on the global batch."""
    return hf_zoo.reference_losses(hf_dir, _global_batch(), STEPS, LR, untie=untie)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("zoo")
    return {arch: str(hf_zoo.save_tiny(root / arch, arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(zoo) -> dict[str, list[float]]:
    torch.manual_seed(0)
    return {arch: _reference(path) for arch, path in zoo.items()}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("exports"))


@pytest.fixture(scope="module")
def runs2(zoo, exports) -> list[dict]:
    return run_distributed(_rank_all, world_size=2, args=(zoo, exports), timeout=400, env=ENV)


@pytest.fixture(scope="module")
def runs4(zoo) -> list[dict]:
    return run_distributed(_rank_all, world_size=4, args=(zoo, ""), timeout=400, env=ENV)


def _close(got: list[float], ref: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(got, ref, strict=True))


def _check(runs: list[dict], key: str, ref: list[float]) -> str:
    """Every rank's losses within TOL of `ref`; returns the table cell."""
    for rank, result in enumerate(runs):
        got = result[key]
        assert "losses" in got, f"{key} rank {rank}: {got}"
        diff = _close(got["losses"], ref)
        assert diff < TOL, f"{key} rank {rank}: loss differs by {diff:.2e}: {got['losses']} vs {ref}"
    print(f"{key}: max loss difference {_close(runs[0][key]['losses'], ref):.1e}")
    return "ok"


def test_references_learn(references):
    for arch, ref in references.items():
        assert ref[-1] < ref[0] - 0.3, f"{arch}: the single-process reference should learn: {ref}"


@pytest.mark.parametrize("arch", ARCHS)
def test_two_rank_layouts_match_transformers_or_are_refused_with_a_fix_that_works(runs2, references, zoo, arch):
    cells = {}
    for name in LAYOUTS_2:
        key = f"{arch}/{name}"
        got = runs2[0][key]
        if "refused" not in got:
            cells[name] = _check(runs2, key, references[arch])
            continue
        line = got["refused"]
        assert "\n" not in line and f"parallel.{name[:2]}" in line, line
        if name == "cp2":  # an attention the ring does not compute (a window): before launch, cp=1 named
            assert "set parallel.cp=1" in line and "config.json" in line, line
            cells[name] = "refused: " + line.split("config.json ", 1)[1].split(" (", 1)[0]
        elif name == "pp2":  # tied head: the named fix, checked against transformers untied the same way
            assert "model.tie_embeddings=false" in line and "fixed" in got, line
            ref = _reference(zoo[arch], untie=True)
            for rank, result in enumerate(runs2):
                fixed = result[key]["fixed"]
                assert "losses" in fixed, f"{key} rank {rank} with model.tie_embeddings=false: {fixed}"
                diff = _close(fixed["losses"], ref)
                assert diff < TOL, f"{key} untied, rank {rank}: loss differs by {diff:.2e}"
            cells[name] = "tied head: refused; ok with model.tie_embeddings=false"
        else:  # the fix names FSDP: the fsdp column of this row ran it
            assert "parallel.tp=1" in line and "parallel.dp_shard" in line, line
            assert "losses" in runs2[0][f"{arch}/fsdp"], "the named fix (FSDP) must train"
            cells[name] = "refused (no TP plan); use FSDP"
    _record(arch, cells)


@pytest.mark.parametrize("arch", ARCHS)
def test_four_rank_2d_composition_matches_transformers(runs4, references, arch):
    key = f"{arch}/2d"
    got = runs4[0][key]
    cell = _check(runs4, key, references[arch])
    _record(arch, {"4 ranks, 2-D": f"{got.get('as', 'fsdp2_tp2')}: {cell}"})


@pytest.mark.parametrize("name", list(LLAMA_4))
def test_llama_four_rank_layouts_match_transformers(runs4, references, name):
    _check(runs4, f"llama/{name}", references["llama"])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", EXPORTED)
def test_export_loads_with_from_pretrained_and_gives_the_same_logits(runs2, exports, zoo, arch, layout):
    from transformers import AutoModelForCausalLM

    got = runs2[0][f"{arch}/{layout}"]
    if "refused" in got:  # no TP checkpoint of an architecture TP refuses (its refusal is tested above)
        assert layout == "tp2" and "no base_model_tp_plan" in got["refused"], got
        return
    assert "logits" in got, got
    where = os.path.join(exports, f"{arch}-{layout}")
    _export_hf(os.path.join(where, "ckpt"), zoo[arch], os.path.join(where, "hf"))
    model, info = AutoModelForCausalLM.from_pretrained(os.path.join(where, "hf"), dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model(_global_batch()[:2, :-1]).logits
    diff = (logits - torch.tensor(got["logits"])).abs().max().item()
    assert diff <= LOGITS_TOL, f"{arch} exported from {layout}: logits differ by {diff:.2e}"


_TABLE: dict[str, dict[str, str]] = {}


def _record(arch: str, cells: dict[str, str]) -> None:
    _TABLE.setdefault(arch, {}).update(cells)


def _render() -> str:
    cols = [*LAYOUTS_2, "4 ranks, 2-D"]
    lines = [BEGIN, "", "| architecture | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for arch in ARCHS:
        row = _TABLE.get(arch, {})
        lines.append(f"| {arch} | " + " | ".join(row.get(c, "") for c in cols) + " |")
    return "\n".join([*lines, "", END])


def test_docs_models_page_has_the_matrix_this_run_found(runs2, runs4):
    """Runs last in this file: the table the tests above filled, against docs/models.md."""
    if len(_TABLE) < len(ARCHS) or any(len(row) < len(LAYOUTS_2) + 1 for row in _TABLE.values()):
        pytest.fail(f"the matrix tests above did not all pass, so there is no table to compare: {_TABLE}")
    table = _render()
    text = DOC.read_text(encoding="utf-8")
    if os.environ.get("MESHRUN_WRITE_MODELS_TABLE") == "1":
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: table, text, flags=re.S)
        DOC.write_text(text, encoding="utf-8")
    assert table in text, f"docs/models.md does not hold this matrix; rerun with MESHRUN_WRITE_MODELS_TABLE=1:\n{table}"
