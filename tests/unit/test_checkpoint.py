"""Checkpoint pieces that need no process group: manifest verification and the per-sample log."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint.samples import consumed_between
from meshrun.data.loader import InfiniteLoader
from meshrun.data.sampler import ResumableDistributedSampler
from meshrun.errors import ConfigError


def _ckpt(tmp_path):
    ckpt = tmp_path / "step-00000005"
    (ckpt / "rng").mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (ckpt / "rng" / "rank-00000.pt").write_bytes(b"rng")
    mf.write_manifest(ckpt, step=5)
    return ckpt


def test_manifest_detects_missing_truncated_and_flipped_files(tmp_path):
    ckpt = _ckpt(tmp_path)
    assert mf.problem(ckpt) is None
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x10
    shard.write_bytes(bytes(data))
    assert mf.problem(ckpt) == f"{shard} fails its sha256 check (corrupt)"
    assert mf.problem(ckpt, checksums=False) is None  # same size: only the checksum sees a flipped bit
    shard.write_bytes(bytes(data[:-1]))
    assert "is 1023 bytes, the manifest says 1024 (truncated" in mf.problem(ckpt)
    (ckpt / "rng" / "rank-00000.pt").unlink()
    shard.write_bytes(bytes(range(256)) * 4)
    assert mf.problem(ckpt) == f"{ckpt / 'rng' / 'rank-00000.pt'} is missing"
    (ckpt / mf.MANIFEST).unlink()
    assert "never committed" in mf.problem(ckpt)


def test_committed_and_uncommitted_directories(tmp_path):
    for name in ("step-00000005", "step-00000010", "step-00000015.tmp-123", "other"):
        (tmp_path / name).mkdir()
    assert [p.name for p in mf.committed(tmp_path)] == ["step-00000010", "step-00000005"]
    assert [p.name for p in mf.uncommitted(tmp_path)] == ["step-00000015.tmp-123"]
    mf.write_latest(tmp_path, "step-00000010")
    assert mf.read_latest(tmp_path) == "step-00000010"


def test_sample_log_indices_are_the_batches_the_loader_delivered():
    """consumed_between reconstructs exactly what each rank's batches held, across an epoch end."""
    n, replicas, batch = 23, 2, 3
    data = TensorDataset(torch.arange(n))
    for rank in range(replicas):
        sampler = ResumableDistributedSampler(n, replicas, rank, seed=7)
        loader = InfiniteLoader(DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True))
        position = (0, 0)
        for _ in range(9):  # 3 batches per epoch per rank: crosses two epoch ends
            (items,) = next(loader)
            state = loader.state_dict()
            after = (state["epoch"], state["consumed"])
            logged = consumed_between(loader, position, after)
            assert [i for _, i in logged] == items.tolist()
            position = after


def _real_ckpt(root):
    """A one-process checkpoint in meshrun's layout: DCP tensors, train state, manifest."""
    import torch.distributed.checkpoint as dcp

    ckpt = root / "checkpoints" / "step-00000003"
    model = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    dcp.save({"model": model, "optim": {"state.w.step": torch.tensor(3.0)}}, checkpoint_id=str(ckpt), no_dist=True)
    torch.save({"step": 3, "layout": {"world_size": 1, "strategy": "ddp"}, "data": {"epoch": 0, "consumed": 24,
                "num_samples": 100}}, ckpt / mf.TRAIN_STATE)
    mf.write_manifest(ckpt, step=3)
    mf.write_latest(ckpt.parent, ckpt.name)
    return ckpt, model


def test_ckpt_list_inspect_and_export_cli(tmp_path, capsys):
    from meshrun.cli.ckpt import main

    ckpt, model = _real_ckpt(tmp_path)
    assert main(["list", str(tmp_path)]) == 0
    assert "step-00000003 (latest)" in capsys.readouterr().out
    (tmp_path / "config.toml").write_text("")  # tmp_path is a run: a mistyped sibling names it
    with pytest.raises(ConfigError, match=f"{tmp_path}x does not exist; .*runs there: .*{tmp_path.name}"):
        main(["list", f"{tmp_path}x"])
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "step        3" in out and "strategy=ddp" in out and "valid       yes" in out
    assert "model.w" in out and "[2, 3]" in out and "bfloat16" in out
    exported = tmp_path / "model.pt"
    assert main(["export", str(ckpt), str(exported), "--format", "torch"]) == 0
    state = torch.load(exported, weights_only=True)
    assert state.keys() == model.keys() and all(torch.equal(state[k], model[k]) for k in model)
    with pytest.raises(ConfigError, match="exists, and this command did not write it; give a new path, or --force"):
        main(["export", str(ckpt), str(exported), "--format", "torch"])  # never overwritten silently
    with pytest.raises(ConfigError, match="--max-shard-size 1GB: only --format hf writes shards"):
        main(["export", str(ckpt), str(tmp_path / "new.pt"), "--format", "torch", "--max-shard-size", "1GB"])
    assert main(["export", str(ckpt), str(exported), "--format", "torch", "--force"]) == 0
    (ckpt / "__0_0.distcp").write_bytes(b"garbage")
    assert main(["inspect", str(ckpt)]) == 1
    assert "valid       NO:" in capsys.readouterr().out
    with pytest.raises(mf.CheckpointError, match="will not export a damaged checkpoint"):
        main(["export", str(ckpt), str(exported), "--force"])


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exports_and_configs_follow_the_umask(tmp_path, umask):
    from meshrun.checkpoint.export import export
    from meshrun.config import load_config, save_config

    ckpt, _ = _real_ckpt(tmp_path)
    old = os.umask(umask)
    try:
        written = [save_config(load_config(None, []), tmp_path / "config.toml")]
        for fmt in ("safetensors", "torch"):
            export(ckpt, tmp_path / f"model.{fmt}", fmt=fmt)
            written.append(tmp_path / f"model.{fmt}")
    finally:
        os.umask(old)
    assert {oct(path.stat().st_mode & 0o777) for path in written} == {oct(0o666 & ~umask)}


@pytest.mark.parametrize(
    ("resume", "restart", "chosen", "abandoned"),
    [
        ("auto", "0", "step-00000015", []),  # the newest valid: 20 is damaged
        ("never", "0", None, ["step-00000005", "step-00000010", "step-00000015", "step-00000020"]),
        ("never", "1", "step-00000015", []),  # a restart keeps the job's own progress
        ("PATH", "0", "step-00000005", ["step-00000010", "step-00000015", "step-00000020"]),
        ("PATH", "1", "step-00000015", []),
    ],
)
def test_which_checkpoint_resume_picks(tmp_path, monkeypatch, resume, restart, chosen, abandoned):
    from meshrun.checkpoint import selection

    root = tmp_path / "checkpoints"
    for step in (5, 10, 15, 20):
        ckpt = root / mf.step_dir_name(step)
        ckpt.mkdir(parents=True)
        (ckpt / "__0_0.distcp").write_bytes(b"x" * step)
        mf.write_manifest(ckpt, step=step)
    (root / "step-00000020" / "__0_0.distcp").write_bytes(b"y" * 20)  # same size, other bytes
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    found = selection.choose(root, str(root / "step-00000005") if resume == "PATH" else resume, session=7)
    assert (found.name if found else None) == chosen
    assert sorted(p.name.split(".")[0] for p in root.glob("*.abandoned-*")) == abandoned


def _checkpointer(tmp_path):
    from meshrun.checkpoint.manager import Checkpointer
    from meshrun.config import CheckpointSection

    env = SimpleNamespace(rank=0, world_size=1, is_main=True, device=torch.device("cpu"))
    return Checkpointer(CheckpointSection(), run_dir=tmp_path, env=env, layout={})


def test_signal_handlers_are_put_back_on_every_exit_path(tmp_path):
    import signal

    def handlers():
        return [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]

    before = handlers()
    with pytest.raises(RuntimeError, match="the loop failed"), _checkpointer(tmp_path) as ckpt:
        assert handlers() != before  # held while training
        raise RuntimeError("the loop failed")
    assert handlers() == before
    ckpt = _checkpointer(tmp_path)
    ckpt.close()
    ckpt.close()  # twice is fine
    assert handlers() == before


def test_a_preemption_saves_and_puts_the_handlers_back(tmp_path, monkeypatch):
    import signal

    from meshrun.checkpoint import Preempted
    from meshrun.checkpoint.preemption import PREEMPTED_FILE

    before = signal.getsignal(signal.SIGTERM)
    ckpt = _checkpointer(tmp_path)
    saved = []
    monkeypatch.setattr(ckpt, "save", lambda state, blocking: saved.append((state.step, blocking)))
    ckpt.samples = SimpleLog()
    ckpt.root.mkdir(parents=True)
    signal.raise_signal(signal.SIGTERM)  # noted by the handler, acted on at the step boundary
    state = SimpleNamespace(step=3)
    with pytest.raises(Preempted, match="SIGTERM at step 3"):
        ckpt.step_done(state)
    assert saved == [(3, True)] and (ckpt.root / PREEMPTED_FILE).is_file()
    assert signal.getsignal(signal.SIGTERM) == before


class SimpleLog:
    def begin_step(self) -> None:
        pass

    def end_step(self, step: int) -> None:
        pass


def test_an_unnamed_rerun_continues_only_its_unfinished_run(tmp_path):
    import os

    from meshrun.config import load_config
    from meshrun.config.dump import save_config
    from meshrun.rundir.runs import unfinished_run

    cfg = load_config(None, [f"train.run_dir={tmp_path}", "train.steps=50"])

    def make_run(name, cfg, *, checkpoint, finished, age):
        run = tmp_path / name
        save_config(cfg, run / "config.toml")
        if checkpoint:
            (mf.checkpoints_dir(run) / mf.step_dir_name(10)).mkdir(parents=True)
        if finished:
            (run / "model.pt").write_bytes(b"")
        os.utime(run / "config.toml", (age, age))
        return run

    assert unfinished_run(cfg) is None  # nothing there yet
    make_run("old", cfg, checkpoint=True, finished=True, age=1_000)
    assert unfinished_run(cfg) is None  # the newest run of these settings finished: a new run
    preempted = make_run("preempted", cfg, checkpoint=True, finished=False, age=2_000)
    assert unfinished_run(cfg) == preempted
    other = load_config(None, [f"train.run_dir={tmp_path}", "train.steps=80"])
    assert unfinished_run(other) is None  # other settings never pick it up
    bigger_world = load_config(None, [f"train.run_dir={tmp_path}", "train.steps=50", "launch.nproc_per_node=4"])
    assert unfinished_run(bigger_world) == preempted  # a new world size reshards from it
    assert unfinished_run(load_config(None, [f"train.run_dir={tmp_path}", "train.steps=50",
                                             "checkpoint.resume=never"])) is None
    make_run("crashed-early", cfg, checkpoint=False, finished=False, age=3_000)
    assert unfinished_run(cfg) is None  # the newest has no checkpoint to continue from


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_init_from_that_does_not_fit_is_refused_before_any_worker_or_directory(tmp_path, capsys, fmt):
    from meshrun.cli import main

    weights = {"tok_embeddings.weight": torch.zeros(7, 3), "norm.weight": torch.ones(3)}
    path = tmp_path / f"w.{fmt}"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(weights, str(path))
    else:
        torch.save(weights, path)
    runs = tmp_path / "runs"
    code = main(["train", "--set", f"model.init_from={path}", "--set", f"train.run_dir={runs}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"model.init_from='{path}' does not fit this model: missing from the checkpoint: layers.0." in err
    assert not runs.exists()
