"""`meshrun submit --scheduler slurm`: the sbatch script's text (--dry-run, checked by bash -n), and bad
input as one line, exit 2, nothing written or submitted (tests/e2e/test_submit_slurm_jobs.py runs real jobs)."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import TINY

from meshrun.cli import main


def _dry(tmp_path, *extra: str) -> list[str]:
    return ["submit", TINY, "--nproc-per-node", "2", "--set", "train.name=t1", "--set",
            f"train.run_dir={tmp_path}", *extra]


@pytest.mark.timeout(60)
def test_dry_run_script(tmp_path, capsys):
    assert main(_dry(tmp_path, "--nodes", "2", "--time", "01:00:00", "--partition", "p1", "--sbatch=--mem=8G",
                     "--signal-lead", "120", "--dry-run")) == 0
    script = capsys.readouterr().out
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 f"#SBATCH --output={tmp_path}/t1/logs/slurm-%j.out", "#SBATCH --signal=B:USR1@120",
                 "#SBATCH --time=01:00:00", "#SBATCH --partition=p1", "#SBATCH --mem=8G"):
        assert line in script.splitlines(), line
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in script
    assert "--nnodes 2 --nproc-per-node 2" in script and '--rdzv-endpoint "$MESHRUN_RDZV_HOST:$MESHRUN_RDZV_PORT"' in script
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"\' USR1' in script
    assert script.count('scontrol requeue "$SLURM_JOB_ID"') == 1
    assert not (tmp_path / "t1").exists()  # a dry run writes nothing
    done = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, timeout=10, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, says", [
    (["--time", "90 minutes"], "--time '90 minutes'"),
    (["--nodes", "0"], "--nodes 0"),
    (["--set", "parallel.tp=4"], "tp"),  # the layout resolver: tp 4 does not divide a world of 2
    (["--image", "x"], "--image is for --scheduler kubernetes"),
    (["--set", "train.name="], "train.name"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, extra, says):
    assert main(_dry(tmp_path, *extra, "--dry-run")) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and says in captured.err, captured.err
    assert not (tmp_path / "t1" / "slurm").exists()


@pytest.mark.timeout(60)
def test_no_sbatch_on_path_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # a machine without SLURM's commands
    assert main(_dry(tmp_path)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'sbatch' is not on PATH" in err, err
    assert not os.path.exists(tmp_path / "t1")


@pytest.mark.timeout(60)
def test_status_without_a_recorded_job_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "bin").mkdir()
    for name in ("squeue", "scancel"):  # never run: the run directory has no job id
        (tmp_path / "bin" / name).write_text("#!/bin/sh\nexit 99\n")
        (tmp_path / "bin" / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert main(["submit", "--status", str(tmp_path)]) == 2
    assert "no job id recorded" in capsys.readouterr().err
