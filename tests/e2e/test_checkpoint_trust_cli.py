"""Checkpoints are data, never code, and must fit the model: real runs, real files, the real CLI.

A crafted `.metadata` pickle that would create a marker file leaves no marker after `ckpt inspect`,
`ckpt export`, `train --resume PATH` and auto-resume; a checkpoint of another model shape exits 2
with one line naming the first differing tensors (resume, auto-resume, init_from).
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
from conftest import TINY, meshrun_each, train_tiny

from meshrun.checkpoint import manifest as mf

ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
FOUR_LAYERS = ["--nproc-per-node", "1", "--set", "train.steps=4", "--set", "train.eval_interval=0",
               "--set", "checkpoint.interval=2", "--set", "metrics.jsonl=false", "--set", "model.n_layers=4"]
TWO_LAYERS_TIED = [*FOUR_LAYERS[:-1], "model.n_layers=2", "--set", "model.tie_embeddings=true"]


class _Marker:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A finished 4-layer run with checkpoints at steps 2 and 4 (one process: the fastest real run)."""
    tmp = tmp_path_factory.mktemp("trust")
    result, run_dir = train_tiny(tmp, "four", *FOUR_LAYERS, timeout=240, env=ENV)
    assert result.returncode == 0, result.output[-3000:]
    return run_dir


def _copy_run(saved: Path, tmp: Path, name: str) -> Path:
    run_dir = tmp / name
    shutil.copytree(saved, run_dir)
    (run_dir / "model.pt").unlink()  # unfinished: a re-run of the name auto-resumes
    return run_dir


def _plant(ckpt: Path, marker: Path, *, vouch: bool) -> None:
    """Replace `.metadata` by a live payload; `vouch`: rewrite the manifest so that its checks pass."""
    payload = pickle.dumps(_Marker(marker))
    pickle.loads(payload)  # control: plain pickle really runs it
    assert marker.exists()
    marker.unlink()
    (ckpt / mf.DCP_METADATA).write_bytes(payload)
    if vouch:
        mf.write_manifest(ckpt, step=int(ckpt.name.split("-")[1]))


def _one_line(result, *expected: str) -> str:
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    assert all(e in lines[0] for e in expected), lines[0]
    return lines[0]


def _train_argv(tmp: Path, name: str, *args: str) -> list[str]:
    """train_tiny's command line, for meshrun_each (cwd=tmp)."""
    return ["train", TINY, "--set", f"train.name={name}", "--set", f"train.run_dir={tmp}", *args]


def test_a_crafted_metadata_pickle_runs_nothing_in_any_command(saved, tmp_path):
    marker, unvouched_marker = tmp_path / "MARKER", tmp_path / "MARKER-UNVOUCHED"
    unvouched = _copy_run(saved, tmp_path, "unvouched") / "checkpoints" / "step-00000004"
    _plant(unvouched, unvouched_marker, vouch=False)  # reported INVALID, must still not be unpickled
    run_dir = _copy_run(saved, tmp_path, "victim")
    ckpt = run_dir / "checkpoints" / "step-00000004"
    _plant(ckpt, marker, vouch=True)  # the manifest vouches for it: the unpickler is the only guard
    # The commands that only read or check, one after another in one process (torch imported once);
    # neither marker may exist after any of them.
    inspect_invalid, inspect, export, resume = meshrun_each(
        ["ckpt", "inspect", str(unvouched)],
        ["ckpt", "inspect", str(ckpt)],
        ["ckpt", "export", str(ckpt), str(tmp_path / "out.pt"), "--format", "torch"],
        _train_argv(tmp_path, "other", *FOUR_LAYERS, "--resume", str(ckpt)),
        timeout=120, cwd=tmp_path, env=ENV)
    assert not unvouched_marker.exists(), "ckpt inspect of an INVALID checkpoint ran the payload"
    assert not marker.exists(), "ckpt inspect, ckpt export or train --resume PATH ran the payload"
    assert inspect_invalid.returncode == 1 and "valid       NO:" in inspect_invalid.stdout, inspect_invalid.output
    assert inspect.returncode == 1 and "not allowed in DCP metadata" in inspect.stdout, inspect.output
    _one_line(export, "not allowed in DCP metadata")
    _one_line(resume, "not allowed in DCP metadata")
    result, _ = train_tiny(tmp_path, "victim", *FOUR_LAYERS, timeout=120, env=ENV)  # auto-resume
    assert not marker.exists(), "auto-resume ran the payload"
    assert result.returncode == 2, result.output[-3000:]
    assert "not allowed in DCP metadata" in result.output and "Traceback" not in result.output


def test_a_damaged_manifest_falls_back_to_the_previous_checkpoint(saved, tmp_path):
    run_dir = _copy_run(saved, tmp_path, "flipped")
    manifest = run_dir / "checkpoints" / "step-00000004" / mf.MANIFEST
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0x04
    manifest.write_bytes(bytes(data))
    result, _ = train_tiny(tmp_path, "flipped", *FOUR_LAYERS, timeout=120, env=ENV)
    assert result.returncode == 0, result.output[-3000:]
    assert "skipping damaged checkpoint step-00000004" in result.output
    assert "resumed from" in result.output and "step-00000002" in result.output


def test_a_checkpoint_of_another_shape_exits_2_naming_the_tensors(saved, tmp_path):
    """The issue's case: a 2-layer model with tied embeddings and a 4-layer checkpoint (it exited 0)."""
    ckpt = saved / "checkpoints" / "step-00000004"
    exported = tmp_path / "four.pt"
    # --resume PATH and model.init_from are refused before launch, and the export between them
    # only reads: one process runs the three, in this order (torch imported once).
    resume, export, init = meshrun_each(
        _train_argv(tmp_path, "small", *TWO_LAYERS_TIED, "--resume", str(ckpt)),
        ["ckpt", "export", str(ckpt), str(exported), "--format", "torch"],
        _train_argv(tmp_path, "init", *TWO_LAYERS_TIED, "--set", f"model.init_from={exported}"),
        timeout=120, cwd=tmp_path, env=ENV)
    _one_line(resume, "does not fit this model", "layers.2.", "not in this model")
    assert export.returncode == 0, export.output
    assert init.returncode == 2, init.output[-3000:]
    assert "does not fit this model" in init.output and "layers.2." in init.output
    assert "Traceback" not in init.output
    _copy_run(saved, tmp_path, "shrunk")
    # auto-resume; --force: other settings than the run's config.toml are refused before launch otherwise
    result, _ = train_tiny(tmp_path, "shrunk", *TWO_LAYERS_TIED, "--force", timeout=120, env=ENV)
    assert result.returncode == 2, result.output[-3000:]
    assert "does not fit this model" in result.output and "layers.2." in result.output
    assert "Traceback" not in result.output
