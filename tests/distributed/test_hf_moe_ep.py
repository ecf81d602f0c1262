"""Expert parallel of Hugging Face mixtures of experts: Mixtral and Qwen2-MoE (tests/hf_zoo.py, 4
experts, top 2; Qwen2-MoE with its gated shared expert) under ep 2 on 2 real gloo ranks, through
meshrun's own path (test_hf_matrix._train: the pre-launch layout rules, build_layout, the weights
loaded into the shards, meshrun's optimizer, layout_step) for 10 steps on one fixed global batch,
against single-process transformers with torch's AdamW: the loss every rank logs matches within
1e-4 (measured: Mixtral 9.5e-7, Qwen2-MoE 4.8e-7). Each rank holds 2 of the 4 experts (the
weights' first dim, FSDP's efsdp being 1) and sends token rows to its peer by all-to-all
(meshrun.parallel.expert_parallel: transformers' experts compute through the implementation meshrun
registers in their ExpertsInterface). On 4 ranks: Mixtral under ep 2 x tp 2 (the attention split,
the experts whole on each tp rank) and Qwen2-MoE under ep 2 x efsdp 2 (each rank 1 expert row);
measured 9.5e-7 and 4.8e-7. (Qwen3-MoE under ep 2, not in the zoo, measured 4.8e-7 the same way.)"""

from __future__ import annotations

import hf_zoo
import pytest
import test_hf_matrix as matrix

from meshrun.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

ARCHS = ("mixtral", "qwen2_moe")
EP2 = dict(strategy="fsdp", dp_shard=2, ep=2)


CASES_4 = {"mixtral": (dict(strategy="fsdp", dp_shard=2, ep=2, tp=2), [2]),
           "qwen2_moe": (dict(strategy="fsdp", dp_shard=4, ep=2), [1])}


def _rank(dirs: dict[str, str]) -> dict[str, dict]:
    return {arch: matrix._train(dirs[arch], EP2, 2) for arch in ARCHS}


def _rank_4(dirs: dict[str, str]) -> dict[str, dict]:
    return {arch: matrix._train(dirs[arch], options, 4) for arch, (options, _) in CASES_4.items()}


def _check(ranks: list[dict], dirs: dict[str, str], rows: dict[str, list[int]]) -> None:
    for arch, expected_rows in rows.items():
        ref = matrix._reference(dirs[arch])
        assert ref[-1] < ref[0] - 0.1, f"{arch}: the reference did not learn"
        for rank, got in enumerate(ranks):
            run = got[arch]
            assert "losses" in run, f"{arch} rank {rank}: {run}"
            diff = max(abs(a - b) for a, b in zip(run["losses"], ref, strict=True))
            assert diff < matrix.TOL, f"{arch} rank {rank}: loss differs by {diff:.2e}"
            assert run["expert_rows"] == expected_rows, f"{arch} rank {rank}: holds {run['expert_rows']} experts"
            assert run["rows_sent"] > 0, f"{arch} rank {rank}: no token went to the peer's experts"


def test_hf_moe_under_ep2_matches_transformers_with_half_the_experts_per_rank(tmp_path):
    dirs = {arch: str(hf_zoo.save_tiny(tmp_path / arch, arch)) for arch in ARCHS}
    ranks = run_distributed(_rank, world_size=2, args=(dirs,), timeout=240, env=matrix.ENV)
    _check(ranks, dirs, {arch: [2] for arch in ARCHS})


def test_hf_moe_ep_with_tp_and_with_fsdp_on_4_ranks_matches_transformers(tmp_path):
    dirs = {arch: str(hf_zoo.save_tiny(tmp_path / arch, arch)) for arch in CASES_4}
    ranks = run_distributed(_rank_4, world_size=4, args=(dirs,), timeout=240, env=matrix.ENV)
    _check(ranks, dirs, {arch: rows for arch, (_, rows) in CASES_4.items()})


def test_meshrun_plan_simulates_an_hf_moe_under_ep(tmp_path):
    """`meshrun plan --simulate` of a model.hf mixture of experts (bf16) under ep 2 x efsdp 2 on 4
    ranks: the experts' tokens travel over ep by all-to-all (rows and counts, forward and back),
    the experts' shards over efsdp. (fp32 is refused by the simulation: torch 2.13's fake
    `_grouped_mm`, transformers' experts on CPU, takes bf16 only, though the CPU kernel takes fp32.)"""
    import json

    from conftest import meshrun

    hf = hf_zoo.save_tiny(tmp_path / "mixtral", "mixtral")
    result = meshrun("plan", "--simulate", "--json", "--world", "4", "--set", f"model.hf={hf}", "--set",
                     "parallel.strategy=fsdp", "--set", "parallel.dp_shard=4", "--set", "parallel.ep=2", "--set",
                     "data.seq_len=16", "--set", "train.dtype=bf16", timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.output
    ranks = json.loads(result.stdout)["ranks"]
    layers = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    for rank in ranks:
        uses = {(c["kind"], c["dim"]): c["count"] for c in rank["collectives"]}
        assert uses[("all_to_all", "ep")] == 5 * layers, uses  # counts, rows out and back, both ways in backward
        assert ("all_gather", "efsdp") in uses and ("reduce_scatter", "efsdp") in uses, uses
