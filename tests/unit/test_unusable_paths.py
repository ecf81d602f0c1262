"""A path the filesystem refuses to look at (a name longer than NAME_MAX: OSError ENAMETOOLONG
from `Path.is_dir`, which Python 3.11 does not swallow) is one line naming the key, the cut value
and the reason, exit 2: never an OSError traceback. model.hf's case is in test_hf_config.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.checkpoint import manifest as mf
from meshrun.checkpoint.manifest import CheckpointError
from meshrun.checkpoint.verify import check_resume
from meshrun.errors import ConfigError, MeshrunError, shown

LONG = "x" * 300  # one name of 300 characters: over NAME_MAX (255) on every Linux filesystem


def _no_model():
    raise AssertionError("the model is built only for a path that is a checkpoint")


def test_checkpoint_resume_with_a_name_too_long_is_one_line(tmp_path):
    for value in (LONG, str(tmp_path / LONG / "step-00000010")):
        with pytest.raises(CheckpointError, match=r"checkpoint.resume\) '.{80}'\.\.\.: not a usable path "
                                                  r"\(File name too long\)") as info:
            check_resume(value, _no_model)
        assert isinstance(info.value, MeshrunError) and "\n" not in str(info.value)


def test_is_checkpoint_says_no_and_unusable_says_why(tmp_path):
    assert not mf.is_checkpoint(tmp_path / LONG)
    assert mf.unusable(tmp_path / LONG) == "File name too long"
    assert mf.unusable(tmp_path / "missing") is None  # absent is not refused: the callers say "not found"


def test_generate_with_a_name_too_long_is_one_line(tmp_path):
    from meshrun.trained.generate import load

    with pytest.raises(ConfigError, match=r"is not a usable path \(File name too long\)"):
        load(tmp_path / LONG)


def test_shown_cuts_long_values():
    assert shown("abc") == "'abc'"
    assert shown("y" * 81) == repr("y" * 80) + "..."


@pytest.mark.parametrize("argv", [["ckpt", "list", LONG], ["data", "prepare", LONG, "--out", "OUT"]],
                         ids=["ckpt-list", "data-prepare"])
def test_any_command_given_a_name_too_long_says_one_line(argv, tmp_path, monkeypatch, capsys):
    """The CLI's net for what no command checked first: one line naming the cut value, exit 2."""
    from meshrun.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"meshrun {argv[0]}: error: '{'x' * 80}'... is not a usable path (File name too long)" in err
    assert not (tmp_path / "OUT").exists()


def test_a_directory_given_as_the_config_file_says_so(tmp_path):
    from meshrun.cli.train import check_train_args

    with pytest.raises(ConfigError, match=r"config file '.*(\.\.\.)? is a directory, not a .toml file"):
        check_train_args([str(tmp_path)])
    with pytest.raises(ConfigError, match=r"config file '.*(\.\.\.)? not found"):
        check_train_args([str(tmp_path / "missing.toml")])


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_directories_a_filesystem_refuses_to_create_are_one_line(tmp_path, monkeypatch, capsys):
    """/proc passes access() for root and then refuses mkdir: the run directory and --log-dir
    still fail with one line, exit 2, and no worker starts."""
    from meshrun.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("raise SystemExit('a worker started')\n")
    assert main(["launch", "--nproc-per-node", "1", "--log-dir", "/proc/meshrun-x", "s.py"]) == 2
    assert "--log-dir '/proc/meshrun-x' cannot be created" in capsys.readouterr().err
    from meshrun.config import load_config
    from meshrun.rundir.runs import claim_run_dir

    with pytest.raises(ConfigError, match=r"train.run_dir/train.name '/proc/meshrun-x' cannot be created"):
        claim_run_dir(load_config(None, ["train.run_dir=/proc/meshrun-x"]), None)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_an_output_the_filesystem_refuses_is_one_line(tmp_path, monkeypatch, capsys):
    """The CLI's net for a file no check caught first (here data prepare's --out under /proc)."""
    from meshrun.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("hello world\n")
    assert main(["data", "prepare", "t.txt", "--out", "/proc/meshrun-x"]) == 2
    err = capsys.readouterr().err
    assert err == "meshrun data: error: '/proc/meshrun-x': No such file or directory\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_train_with_a_log_dir_that_cannot_be_made_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    """`meshrun train --log-dir` is checked before the run directory is created: the one line,
    exit 2, and no empty run directory (nor config.toml) left behind."""
    from meshrun.cli import main

    monkeypatch.chdir(tmp_path)
    tiny = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
    argv = ["train", str(tiny), "--log-dir", "/proc/meshrun-x", "--set", f"train.run_dir={tmp_path / 'runs'}",
            "--set", "train.name=t"]
    assert main(argv) == 2
    assert "--log-dir '/proc/meshrun-x' cannot be created" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
