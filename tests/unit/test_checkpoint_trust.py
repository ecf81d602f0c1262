"""Checkpoints are data, never code: restricted unpickling, strict manifests, a bit-flip sweep, fit checks."""

from __future__ import annotations

import enum
import hashlib
import io
import json
import os
import pathlib
import pickle
import random
import subprocess
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint import safe_load, selection
from meshrun.checkpoint.verify import check_fits


class _Marker:
    """Unpickled by plain pickle, this creates the file `path` (what an attacker's os.system would do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _save(ckpt, step, *, extra=None):
    """A real one-process checkpoint of meshrun's layout: DCP model + flattened optimizer, train state."""
    model = {"tok.weight": torch.randn(8, 4), "out.bias": torch.zeros(8, dtype=torch.bfloat16)}
    optim = {"state.tok.weight.step": torch.tensor(float(step)), "param_groups.tok.weight.lr": 1e-3,
             "param_groups.tok.weight.betas": (0.9, 0.95)}
    state = {"model": model, "optim": optim, **({"extra": extra} if extra is not None else {})}
    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    torch.save({"step": step, "layout": {"world_size": 1, "strategy": "ddp"}, "data": {}}, ckpt / mf.TRAIN_STATE)
    mf.write_manifest(ckpt, step=step, layout={"world_size": 1, "strategy": "ddp", "tp": 1}, session=123456789,
                      time=time.time())
    return state


def _run(tmp_path, steps=(1, 2)):
    root = tmp_path / "checkpoints"
    for step in steps:
        _save(root / mf.step_dir_name(step), step)
    return root


def test_real_metadata_reads_through_the_allow_list_and_loads(tmp_path):
    ckpt = tmp_path / "step-00000001"
    saved = _save(ckpt, 1)
    metadata = safe_load.SafeReader(str(ckpt)).read_metadata()
    assert metadata.state_dict_metadata["model.tok.weight"].size == torch.Size([8, 4])
    target = {"model": {k: torch.empty_like(v) for k, v in saved["model"].items()},
              "optim": {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None)
                        for k, v in saved["optim"].items()}}
    safe_load.load(target, ckpt, no_dist=True)
    assert all(torch.equal(target["model"][k], saved["model"][k]) for k in saved["model"])
    assert target["optim"]["param_groups.tok.weight.betas"] == (0.9, 0.95)  # a non-tensor, weights-only


def test_a_crafted_metadata_pickle_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Marker(marker))
    pickle.loads(payload)  # the payload is live: plain pickle runs it
    assert marker.exists()
    marker.unlink()
    ckpt = tmp_path / "step-00000001"
    _save(ckpt, 1)
    (ckpt / mf.DCP_METADATA).write_bytes(payload)
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not allowed|os.system is not allowed"):
        safe_load.SafeReader(str(ckpt)).read_metadata()
    mf.write_manifest(ckpt, step=1)  # even with a manifest that vouches for it
    assert mf.problem(ckpt) is None
    with pytest.raises(mf.CheckpointError, match="no readable DCP metadata"):
        check_fits(ckpt, {})
    assert not marker.exists()


class _ByNamePickler(pickle.Pickler):
    """Pickles an Enum member as early Python 3.11 releases do (3.11.2, Debian 12's): getattr(Enum, NAME)."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


class _Attr:
    """Unpickles as getattr(owner, name): what a crafted metadata would reach through builtins.getattr."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def _by_name(value) -> bytes:
    out = io.BytesIO()
    _ByNamePickler(out).dump(value)
    return out.getvalue()


def test_metadata_pickled_by_enum_name_reads_and_getattr_reaches_nothing_else(tmp_path):
    ckpt = tmp_path / "step-00000001"
    _save(ckpt, 1)
    metadata = safe_load.SafeReader(str(ckpt)).read_metadata()
    by_name = _by_name(metadata)
    assert b"getattr" in by_name and b"_MEM_FORMAT_ENCODING" in by_name  # the form under test is there
    again = safe_load.loads_metadata(by_name)
    assert again.state_dict_metadata == metadata.state_dict_metadata
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    for owner, name in [(Metadata, "__init__"), (pathlib.PosixPath, "write_text"), (torch.Size, "__class__"),
                        (_MEM_FORMAT_ENCODING, "__class__"), (_MEM_FORMAT_ENCODING, "_member_map_")]:
        with pytest.raises(pickle.UnpicklingError, match="getattr is allowed in DCP metadata only for an Enum member"):
            safe_load.loads_metadata(pickle.dumps(_Attr(owner, name)))
    with pytest.raises(pickle.UnpicklingError, match="subprocess.Popen is not allowed"):
        safe_load.loads_metadata(pickle.dumps(_Attr(subprocess.Popen, "__init__")))


def test_a_crafted_non_tensor_value_runs_nothing(tmp_path):
    """DCP's own planner reads non-tensor values with torch.load(weights_only=False); meshrun's does not."""
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "step-00000001"
    saved = _save(ckpt, 1, extra=_Marker(marker))
    target = {"model": {k: torch.empty_like(v) for k, v in saved["model"].items()}, "extra": None}
    with pytest.raises(mf.CheckpointError, match=r"does not load \(UnpicklingError: .*posix.system"):
        safe_load.load(target, ckpt, no_dist=True)
    assert not marker.exists()
    with pytest.warns(UserWarning):
        dcp.load(target, checkpoint_id=str(ckpt), no_dist=True)  # the hole it closes
    assert marker.exists()


def _rewrite(ckpt, change):
    """Rewrite the manifest with `change` applied and a matching digest: only the field checks can object."""
    manifest = json.loads((ckpt / mf.MANIFEST).read_text())
    del manifest["manifest_sha256"]
    change(manifest)
    if isinstance(manifest, dict):
        manifest["manifest_sha256"] = hashlib.sha256(json.dumps(manifest, indent=1, sort_keys=True).encode()
                                                     ).hexdigest()
    (ckpt / mf.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _first_file(m):
    return m["files"][sorted(m["files"])[0]]


MALFORMED = {
    "bytes is a string": lambda m: _first_file(m).update(bytes=str(_first_file(m)["bytes"])),
    "bytes is missing": lambda m: _first_file(m).pop("bytes"),
    "bytes is negative": lambda m: _first_file(m).update(bytes=-1),
    "bytes is a bool": lambda m: _first_file(m).update(bytes=True),
    "sha256 is short": lambda m: _first_file(m).update(sha256="ab"),
    "files is a list": lambda m: m.update(files=list(m["files"])),
    "files is empty": lambda m: m.update(files={}),
    "a path escapes": lambda m: m["files"].update({"../../x": _first_file(m)}),
    "step is a float": lambda m: m.update(step=2.0),
    "step is another": lambda m: m.update(step=1),
    "step is missing": lambda m: m.pop("step"),
    "an unknown key": lambda m: m.update(extra=1),
    "layout is nested": lambda m: m["layout"].update(tp={"x": 1}),
    "time is negative": lambda m: m.update(time=-5.0),
    "version is 3": lambda m: m.update(version=3),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_manifest_is_damaged_and_auto_falls_back(tmp_path, name):
    root = _run(tmp_path)
    _rewrite(root / "step-00000002", MALFORMED[name])
    assert "step-00000002" in mf.problem(root / "step-00000002")
    assert selection.latest_valid(root) == root / "step-00000001"


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]", b"\xff\xfe", b"NaN", b"[" * 100_000,
                                     b" " * (mf.MAX_MANIFEST_BYTES + 1)])
def test_unparseable_and_huge_manifests_are_damaged(tmp_path, content):
    root = _run(tmp_path)
    (root / "step-00000002" / mf.MANIFEST).write_bytes(content)
    assert "manifest.json is damaged" in mf.problem(root / "step-00000002")
    assert selection.latest_valid(root) == root / "step-00000001"
    with pytest.raises(mf.CheckpointError):
        selection.choose(root, str(root / "step-00000002"), session=1)


def test_manifest_bit_flip_sweep(tmp_path, monkeypatch):
    """Every flipped bit of a real manifest: never a crash, never accepted; auto falls back to step 1."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    root = _run(tmp_path)
    newest = root / "step-00000002"
    original = (newest / mf.MANIFEST).read_bytes()
    bits = len(original) * 8
    positions = random.Random(12).sample(range(bits), min(bits, 1500))
    crashes, accepted = [], []
    for bit in positions:
        flipped = bytearray(original)
        flipped[bit // 8] ^= 1 << (bit % 8)
        (newest / mf.MANIFEST).write_bytes(bytes(flipped))
        try:
            if selection.latest_valid(root) != root / "step-00000001":
                accepted.append(bit)
            selection.choose(root, str(newest), session=1)  # --resume PATH: one clean line
            accepted.append(bit)
        except mf.CheckpointError:
            pass
        except Exception as exc:  # noqa: BLE001 - counted, the assertion names them
            crashes.append((bit, repr(exc)))
    print(f"manifest bit-flip sweep: {len(positions)} flips of {bits} bits, {len(crashes)} crashes, "
          f"{len(accepted)} accepted")
    assert len(positions) >= 1000
    assert crashes == [] and accepted == []
    (newest / mf.MANIFEST).write_bytes(original)
    assert selection.latest_valid(root) == newest  # the sweep's control: the intact manifest is accepted


def test_a_file_added_after_the_manifest_is_damage(tmp_path):
    ckpt = tmp_path / "step-00000001"
    _save(ckpt, 1)
    (ckpt / "__9_0.distcp").write_bytes(b"x")
    assert "is not in the manifest.json" in mf.problem(ckpt)


def test_check_fits_names_the_first_differing_tensors(tmp_path):
    ckpt = tmp_path / "step-00000001"
    _save(ckpt, 1)
    check_fits(ckpt, {"tok.weight": (8, 4), "out.bias": (8,)})
    with pytest.raises(mf.CheckpointError, match=r"not in this model: out.bias") as info:
        check_fits(ckpt, {"tok.weight": (8, 4)})  # a checkpoint with more tensors than the model
    assert "\n" not in str(info.value)
    with pytest.raises(mf.CheckpointError, match=r"missing from the checkpoint: layers.0.w"):
        check_fits(ckpt, {"tok.weight": (8, 4), "out.bias": (8,), "layers.0.w": (2,)})
    with pytest.raises(mf.CheckpointError, match=r"of another shape: tok.weight \[8, 4\] saved, \[8, 2\] here"):
        check_fits(ckpt, {"tok.weight": torch.empty(8, 2), "out.bias": torch.empty(8)})


def test_init_from_with_more_weights_than_the_model_is_refused(tmp_path):
    from meshrun.checkpoint.export import load_consolidated
    from meshrun.errors import ModelError

    small = torch.nn.Sequential(torch.nn.Linear(2, 2))
    big = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    torch.save(big.state_dict(), tmp_path / "big.pt")
    with pytest.raises(ModelError, match=r"does not fit this model: not in this model: 1.bias, 1.weight;"):
        load_consolidated(small, tmp_path / "big.pt")


@pytest.mark.parametrize("module_name", ["builtins eval", "os system", "torch load", "torch onnx",
                                         "torch.distributed.checkpoint.metadata os", "pathlib Path.write_text",
                                         "torch.serialization load"])
def test_the_metadata_allow_list_resolves_nothing_else(module_name):
    module, name = module_name.split()
    with pytest.raises(pickle.UnpicklingError, match="is not allowed in DCP metadata"):
        safe_load.loads_metadata(f"c{module}\n{name}\n.".encode())  # protocol 0: GLOBAL, STOP
    with pytest.raises(pickle.UnpicklingError, match="not a DCP Metadata"):
        safe_load.loads_metadata(pickle.dumps({"state_dict_metadata": {}}))


def test_metadata_that_points_outside_the_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "step-00000001"
    _save(ckpt, 1)
    metadata = safe_load.SafeReader(str(ckpt)).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with pytest.raises(pickle.UnpicklingError, match="not a file of the checkpoint directory"):
        safe_load.loads_metadata(pickle.dumps(metadata))
