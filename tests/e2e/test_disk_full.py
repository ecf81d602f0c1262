"""A disk that fills mid-save leaves the previous checkpoint loadable and prints a summary.

The run directory is a 3 MB tmpfs: the step-2 checkpoint (about 2.1 MB) fits, step 4's does
not. Needs root to mount; tests/unit/test_write_faults.py covers the same paths as any user
through a file-size limit (EFBIG).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import train_tiny

from meshrun.checkpoint import manifest as mf

SMALL, ROOMY = "3m", "16m"  # a tiny checkpoint is about 2.1 MB


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; test_write_faults.py covers this as any user (EFBIG)")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL}", "tmpfs", str(mount)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN in this container?): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def test_disk_full_mid_save_keeps_the_previous_checkpoint_and_resumes(small_disk: Path):
    args = ("--set", "train.steps=4", "--set", "checkpoint.interval=2", "--set", "train.eval_interval=100",
            "--set", "metrics.jsonl=false")  # no report to render: seconds of CPU saved
    result, run_dir = train_tiny(small_disk, "full", *args)
    out = result.output
    assert result.returncode == 1, out
    assert "meshrun: job failed" in out  # the launcher's summary, not a JSONDecodeError
    assert "checkpoint step-00000004 could not be written to" in out and str(run_dir) in out, out
    assert "No space left on device (ENOSPC); needs about 2." in out, out
    assert "step-00000002 is intact and `latest` still names it" in out, out
    assert "Traceback" not in out, out
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000002"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-00000002"]  # the .tmp write is gone

    subprocess.run(["mount", "-o", f"remount,size={ROOMY}", str(small_disk)], check=True, timeout=30)
    assert mf.problem(checkpoints / "step-00000002") is None  # what `meshrun ckpt inspect` calls valid
    resumed, _ = train_tiny(small_disk, "full", *args)
    assert resumed.returncode == 0, resumed.output
    assert "resumed from" in resumed.output and "step-00000002" in resumed.output, resumed.output
    assert (checkpoints / "latest").read_text().strip() == "step-00000004"
