"""A full /dev/shm is one line before anything starts, not torch's traceback from the agent.

torch's agent makes a POSIX semaphore (in /dev/shm) for each worker's result queue; on a full
/dev/shm that raised OSError ENOSPC from deep inside `start_processes`. The test gives
`meshrun train` and `meshrun launch` a full 64 KiB tmpfs at /dev/shm in a mount namespace of
their own (unshare -m, as root), so the machine's /dev/shm is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from conftest import BIN, TINY, child_env, run_proc

FILL = "mount -t tmpfs -o size=64k tmpfs /dev/shm && (cat /dev/zero > /dev/shm/fill 2>/dev/null; true) && exec \"$@\""


def _namespaces_work() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) for a private /dev/shm"
    done = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                          capture_output=True, timeout=30)
    return None if done.returncode == 0 else f"unshare -m cannot mount here: {done.stderr.decode().strip()}"


@pytest.mark.parametrize("command", ["train", "launch"])
def test_a_full_dev_shm_is_one_line_and_nothing_created(tmp_path, command):
    why = _namespaces_work()
    if why is not None:
        pytest.skip(why)
    (tmp_path / "script.py").write_text("print('ran')\n")
    args = (["train", TINY, "--set", f"train.run_dir={tmp_path}/runs", "--set", "train.name=shm"]
            if command == "train" else ["launch", "--nproc-per-node", "2", "--log-dir", f"{tmp_path}/logs",
                                        str(tmp_path / "script.py")])
    result = run_proc(["unshare", "-m", "sh", "-c", FILL, "sh", str(BIN / "meshrun"), *args],
                      cwd=tmp_path, env=child_env(), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"meshrun {command}: error: /dev/shm cannot hold a semaphore"), lines[0]
    assert "--shm-size" in lines[0] and "ran" not in result.stdout
    assert not (tmp_path / "runs").exists()
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir()) if (tmp_path / "logs").exists() else []
    assert logs in ([], ["launch_error.json"]), logs  # the refusal, recorded for `meshrun diagnose`
