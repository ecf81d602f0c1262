"""Outputs never destroy inputs: no file a user made is deleted or overwritten without --force.

A checkpoint directory is deleted (rotation, a step saved again, a write that never committed)
only when it holds nothing but a save's own files; else it is renamed *.abandoned-* and kept.
`ckpt export`, `data prepare` and `report --out` refuse a path inside a checkpoint or an input,
and a file they did not write (unless --force), before they create anything.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshrun.checkpoint import manifest as mf
from meshrun.errors import ConfigError


@pytest.fixture
def make_checkpointer():
    """Checkpointers for one process, closed at the end: a Checkpointer holds SIGTERM and SIGINT
    from its construction, and a handler left behind makes every later forked child of this
    pytest process ignore SIGTERM (a Pool's terminate() then waits for ever)."""
    import signal

    from meshrun.checkpoint.manager import Checkpointer
    from meshrun.config import CheckpointSection

    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    made = []

    def make(run_dir, keep=1):
        env = SimpleNamespace(rank=0, world_size=1, is_main=True, device=torch.device("cpu"))
        made.append(Checkpointer(CheckpointSection(keep=keep), run_dir=run_dir, env=env, layout={}))
        return made[-1]

    yield make
    for ckpt in made:
        ckpt.close()
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == before


def _commit(ckpt, step):
    """What a save leaves before its commit: DCP files, the train state, a rank's RNG state."""
    tmp = ckpt.root / f"{mf.step_dir_name(step)}.tmp-{ckpt.session}"
    (tmp / "rng").mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"w" * (100 + step))
    (tmp / mf.DCP_METADATA).write_bytes(b"meta")
    (tmp / mf.TRAIN_STATE).write_bytes(b"state")
    (tmp / "rng" / "rank-00000.pt").write_bytes(b"rng")
    ckpt._commit(tmp, step)
    return ckpt.root / mf.step_dir_name(step)


def _names(root):
    return sorted(p.name.split(".abandoned-")[0] + (".abandoned-S" if ".abandoned-" in p.name else "")
                  for p in root.iterdir() if p.is_dir())


def test_rotation_deletes_its_own_checkpoints_and_keeps_one_holding_a_user_file(tmp_path, make_checkpointer):
    ckpt = make_checkpointer(tmp_path, keep=1)
    first = _commit(ckpt, 1)
    (first / "model.safetensors").write_bytes(b"the user's export")  # `ckpt export` into the checkpoint
    _commit(ckpt, 2)
    assert _names(ckpt.root) == ["step-00000001.abandoned-S", "step-00000002"]
    kept = next(ckpt.root.glob("step-00000001.abandoned-*"))
    assert (kept / "model.safetensors").read_bytes() == b"the user's export"
    _commit(ckpt, 3)  # step 2 holds only a save's files and its manifest matches: it goes
    assert _names(ckpt.root) == ["step-00000001.abandoned-S", "step-00000003"]
    truncated = ckpt.root / "step-00000003" / "__0_0.distcp"
    truncated.write_bytes(b"w")  # damaged: not provably complete, so not deleted either
    _commit(ckpt, 4)
    assert _names(ckpt.root) == ["step-00000001.abandoned-S", "step-00000003.abandoned-S", "step-00000004"]
    assert [p.name for p in mf.committed(ckpt.root)] == ["step-00000004"]  # never resumed from


def test_a_step_saved_again_keeps_the_old_directory_when_it_holds_a_user_file(tmp_path, make_checkpointer):
    ckpt = make_checkpointer(tmp_path, keep=3)
    old = _commit(ckpt, 2)
    (old / "notes.txt").write_text("mine")
    _commit(ckpt, 2)  # a redone step after a restart
    kept = next(ckpt.root.glob("step-00000002.abandoned-*"))
    assert (kept / "notes.txt").read_text() == "mine"
    assert mf.problem(ckpt.root / "step-00000002") is None
    _commit(ckpt, 2)  # its own directory, saved again: replaced, nothing more set aside
    assert len(list(ckpt.root.glob("step-00000002.abandoned-*"))) == 1


def test_an_uncommitted_write_goes_unless_it_holds_a_user_file(tmp_path):
    from meshrun.checkpoint.selection import drop_uncommitted

    root = tmp_path / "checkpoints"
    own = root / "step-00000005.tmp-1"
    (own / "rng").mkdir(parents=True)
    (own / "__0_0.distcp").write_bytes(b"partial")
    (own / "rng" / "rank-00001.pt").write_bytes(b"rng")
    mixed = root / "step-00000006.tmp-1"
    mixed.mkdir()
    (mixed / "__1_0.distcp").write_bytes(b"partial")
    (mixed / "export.safetensors").write_bytes(b"user")
    drop_uncommitted(root, session=9)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000006.tmp-1.abandoned-9"]
    assert (root / "step-00000006.tmp-1.abandoned-9" / "export.safetensors").read_bytes() == b"user"
    drop_uncommitted(root, session=10)  # set aside once: never picked up again
    assert sorted(p.name for p in root.iterdir()) == ["step-00000006.tmp-1.abandoned-9"]
    assert mf.uncommitted(root) == []


def _real_ckpt(run_dir):
    import torch.distributed.checkpoint as dcp

    ckpt = run_dir / "checkpoints" / "step-00000003"
    dcp.save({"model": {"w": torch.ones(2, 3)}}, checkpoint_id=str(ckpt), no_dist=True)
    torch.save({"step": 3, "layout": {"world_size": 1, "strategy": "ddp"}}, ckpt / mf.TRAIN_STATE)
    mf.write_manifest(ckpt, step=3)
    mf.write_latest(ckpt.parent, ckpt.name)
    return ckpt


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("where", ["inside", "root", "latest"])
@pytest.mark.parametrize("fmt", ["safetensors", "torch", "hf"])
def test_ckpt_export_never_writes_into_a_checkpoint_even_with_force(tmp_path, where, fmt):
    from meshrun.cli.ckpt import main

    ckpt = _real_ckpt(tmp_path)
    before = _listing(tmp_path)
    out = {"inside": ckpt / "model.out", "root": ckpt.parent / "model.out", "latest": ckpt.parent / "latest"}[where]
    out = out.parent / "hf" if fmt == "hf" and where != "latest" else out
    latest = (ckpt.parent / "latest").read_bytes()
    for force in ([], ["--force"]):
        with pytest.raises(ConfigError, match=r"^OUT .* is inside (the checkpoint|a run's checkpoints "
                                              r"directory) .*; give a path outside it$"):
            main(["export", str(ckpt), str(out), "--format", fmt, *force])
    assert _listing(tmp_path) == before and mf.problem(ckpt) is None
    assert (ckpt.parent / "latest").read_bytes() == latest


def test_ckpt_export_replaces_a_file_only_with_force(tmp_path):
    from meshrun.cli.ckpt import main

    ckpt = _real_ckpt(tmp_path)
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(b"the user's")
    with pytest.raises(ConfigError, match="exists, and this command did not write it; give a new path, or --force"):
        main(["export", str(ckpt), str(mine)])
    assert mine.read_bytes() == b"the user's"
    link = tmp_path / "link.safetensors"
    link.symlink_to(mine)
    with pytest.raises(ConfigError, match="exists"):
        main(["export", str(ckpt), str(link)])
    assert main(["export", str(ckpt), str(mine), "--force"]) == 0


def _prepare(argv, capsys):
    from meshrun.cli.data import main

    code = main(["prepare", *argv])
    return code, capsys.readouterr().err.strip()


def test_data_prepare_never_overwrites_an_input_or_a_file_it_did_not_write(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    text = "a document of the user's\n" * 20
    for name in ("tokens.bin", "meta.json"):  # inputs that sit where the output goes
        (data / name).write_text(text)
        code, err = _prepare([str(data / name), "--out", str(data)], capsys)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "it would write '" in err and ", which is the input '" in err
        code, err = _prepare([str(data / name), "--out", str(data), "--force"], capsys)
        assert code == 2 and "which is the input" in err
        assert (data / name).read_text() == text
        (data / name).unlink()
    (data / "corpus.txt").write_text(text)
    code, err = _prepare([str(data / "corpus.txt"), "--out", str(data / "corpus.txt")], capsys)
    assert code == 2 and "is the input" in err and (data / "corpus.txt").read_text() == text
    # a tokens.bin it did not write (no meta.json of its own beside it): only with --force
    (data / "tokens.bin").write_text("someone else's")
    code, err = _prepare([str(data / "corpus.txt"), "--out", str(data)], capsys)
    assert code == 2 and " exists, and this command did not write it" in err and "--force" in err
    assert (data / "tokens.bin").read_text() == "someone else's" and not (data / "meta.json").exists()
    assert _prepare([str(data / "corpus.txt"), "--out", str(data), "--force"], capsys)[0] == 0
    assert _prepare([str(data / "corpus.txt"), "--out", str(data)], capsys)[0] == 0  # its own: re-prepared


def test_data_prepare_and_report_refuse_a_checkpoint_and_an_input_directory(tmp_path, capsys):
    from meshrun.cli.report import main as report

    ckpt = _real_ckpt(tmp_path / "run")
    before = _listing(tmp_path)
    (tmp_path / "corpus.txt").write_text("text\n" * 10)
    code, err = _prepare([str(tmp_path / "corpus.txt"), "--out", str(ckpt)], capsys)
    assert code == 2 and "is inside the checkpoint" in err
    code, err = _prepare([str(tmp_path / "corpus.txt"), "--out", str(ckpt.parent / "tokens")], capsys)
    assert code == 2 and "a run's checkpoints directory" in err
    with pytest.raises(ConfigError, match="is inside the checkpoint"):
        report([str(tmp_path / "run"), "--out", str(ckpt / "report")])
    assert _listing(tmp_path) == sorted([*before, "corpus.txt"]) and mf.problem(ckpt) is None
    code, err = _prepare([str(tmp_path / "run"), "--out", str(tmp_path / "run" / "tokens")], capsys)
    assert code == 2 and "is inside the input directory" in err
