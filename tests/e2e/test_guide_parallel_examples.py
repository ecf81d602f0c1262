"""The guide's FSDP2, DTensor, TP and PP sections as examples: each runs under `meshrun launch` on CPU.

Each example checks itself against one process and prints a verifiable line; here we launch it
with 2 gloo workers and read that line back.
"""

from __future__ import annotations

import re

import pytest
from conftest import EXAMPLES, meshrun

pytestmark = pytest.mark.timeout(240)

GUIDE = EXAMPLES / "guide"


def launch(name: str, tmp_path, nproc: int = 2):
    result = meshrun("launch", "--nproc-per-node", str(nproc), str(GUIDE / name), cwd=tmp_path, timeout=200)
    assert result.returncode == 0, result.output
    return result


def test_fsdp2_minimal(tmp_path):
    out = launch("fsdp2_minimal.py", tmp_path).stdout
    steps = re.findall(r"^\[rank 0\] step (\d) loss=([\d.]+)$", out, re.M)
    assert [s for s, _ in steps] == ["0", "1", "2", "3", "4"], out
    assert float(steps[-1][1]) < float(steps[0][1])
    match = re.search(r"^\[rank 0\] fsdp2 ok: world_size=2, layers.0 weight local \(32, 64\) of \(64, 64\) "
                      r"\(Shard\(dim=0\),\), .* matches one process within (\S+)$", out, re.M)
    assert match and float(match.group(1)) <= 1e-5, out
    assert "[rank 1] fsdp2 ok" not in out


def test_dtensor_mesh(tmp_path):
    out = launch("dtensor_mesh.py", tmp_path).stdout
    oks = re.findall(r"^\[rank 0\] ok (.*)$", out, re.M)
    assert len(oks) == 8, out
    assert any("Partial(): sum of the ranks' terms = 3" in line for line in oks), oks
    assert any("Shard(0) -> Shard(1): local (8, 8)" in line for line in oks), oks
    assert "[rank 0] dtensor ok: world_size=2, mesh (2,) ('dp',)" in out


def test_tp_mlp(tmp_path):
    out = launch("tp_mlp.py", tmp_path).stdout
    assert ("[rank 0] w1 (Shard(dim=0),) local (32, 16) of (64, 16); "
            "w2 (Shard(dim=1),) local (16, 32) of (16, 64)") in out, out
    match = re.search(r"^\[rank 0\] tp_mlp ok: world_size=2, .* within (\S+)$", out, re.M)
    assert match and float(match.group(1)) <= 1e-5, out


def test_pp_gpipe(tmp_path):
    out = launch("pp_gpipe.py", tmp_path).stdout
    assert re.search(r"^\[rank 0\] guide's literal step\(x\) on every rank: forward only, 0 of \d+ "
                     r"parameters got a gradient$", out, re.M), out
    match = re.search(r"^\[rank 0\] pp ok: 2 stage\(s\), GPipe with 4 micro-batches, loss ([\d.]+) -> "
                      r"([\d.]+), matches one process within (\S+)$", out, re.M)
    assert match, out
    assert float(match.group(2)) < float(match.group(1)) and float(match.group(3)) <= 1e-5
