"""In-memory snapshot files: exact round trip, and a torn, truncated or damaged file is no snapshot."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from meshrun.checkpoint.snapshot import Snapshots
from meshrun.checkpoint.snapshot_area import ENV, remove_stale, snapshot_area
from meshrun.checkpoint.snapshot_files import (
    newest_files,
    read_snapshot,
    snapshot_name,
    snapshot_step,
    write_snapshot,
)
from meshrun.runtime.process import DistEnv

TREE = {"tensors": {"model": {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.bfloat16)},
                    "optim": {"state.w.step": torch.tensor(7.0), "param_groups.w.betas": (0.9, 0.95),
                              "param_groups.w.lr": 1e-3}},
        "rng": {"python": [3, list(range(5)), None], "torch": torch.get_rng_state()},
        "train": {"step": 12, "data": {"epoch": 0, "consumed": 96}, "extra": {}}}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_round_trip_is_exact(tmp_path):
    path = tmp_path / snapshot_name(12)
    write_snapshot(path, step=12, tree=TREE, meta={"world_size": 2})
    step, tree, meta = read_snapshot(path)
    assert step == 12 and meta == {"world_size": 2} and _same(TREE, tree)
    assert snapshot_step(path) == 12 and [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def test_torn_truncated_or_flipped_files_are_ignored(tmp_path):
    good = tmp_path / snapshot_name(3)
    write_snapshot(good, step=3, tree=TREE, meta={})
    data = good.read_bytes()
    for name, damaged in [("truncated", data[:-10]), ("header only", data[:40]), ("empty", b""),
                          ("flipped header", data[:30] + bytes([data[30] ^ 1]) + data[31:]), ("other magic", b"X" + data[1:])]:
        path = tmp_path / f"{name}.snap"
        path.write_bytes(damaged)
        assert read_snapshot(path) is None, name
    assert snapshot_step(tmp_path / f".{snapshot_name(4)}.tmp-123") is None  # a write in progress


def test_a_rank_skips_its_torn_newest_snapshot_for_the_one_before(tmp_path, monkeypatch):
    """A kill in the middle of a write: the half-written newest (temp or truncated) is no candidate."""
    monkeypatch.setenv(ENV, str(tmp_path))
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")

    class Cfg:
        snapshot_interval = 1

    snaps = Snapshots(Cfg(), run_dir=tmp_path, env=env, layout={"strategy": "ddp"})
    (tmp_path / "rank0").mkdir()
    for step in (4, 5):
        write_snapshot(tmp_path / "rank0" / snapshot_name(step), step=step, tree=TREE, meta=snaps.meta)
    newest = tmp_path / "rank0" / snapshot_name(5)
    newest.write_bytes(newest.read_bytes()[:-1])
    (tmp_path / "rank0" / f".{snapshot_name(6)}.tmp-99").write_bytes(b"MRSNAP01")
    assert sorted(newest_files(snaps.dir, snaps.meta, 2)) == [4]
    assert not list((tmp_path / "rank0").glob(".*"))  # the dead writer's temp file is gone
    other = Snapshots(Cfg(), run_dir=tmp_path, env=env, layout={"strategy": "fsdp"})  # another layout
    assert newest_files(other.dir, other.meta, 2) == {}


def test_launcher_area_is_removed_and_stale_ones_by_dead_pid(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRUN_SNAPSHOT_ROOT", str(tmp_path))
    dead = tmp_path / "meshrun-999999999-abcd"  # no such pid
    dead.mkdir()
    live = tmp_path / f"meshrun-{os.getppid()}-abcd"
    live.mkdir()
    with snapshot_area(enabled=True) as area:
        assert area is not None and Path(os.environ[ENV]) == area and area.is_dir()
        assert not dead.exists() and live.exists()
    assert not area.exists() and ENV not in os.environ
    assert remove_stale(tmp_path) == [] and live.exists()
