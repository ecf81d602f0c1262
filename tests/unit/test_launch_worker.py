"""The worker bootstrap (launch/worker_main.py): what a script's first line waits for, and what
a failure leaves behind. Real processes, no launcher: the bootstrap is run as the agent runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from meshrun.launch.spec import WORKER_MAIN

FIRST_LINE = """\
import sys
heavy = ("json", "traceback", "runpy", "pkgutil", "meshrun", "meshrun.debug", "meshrun.debug.hooks")
print(sorted(m for m in heavy if m in sys.modules), __name__, __file__, sys.argv[1:], flush=True)
import torch
from meshrun.runtime import process
print("hooks installed:", process.get().debug.installed, flush=True)
"""


def _worker(tmp_path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    environ = {"PATH": "/usr/bin:/bin", "RANK": "0", "TORCHELASTIC_RUN_ID": "t", **env}
    return subprocess.run([sys.executable, "-u", WORKER_MAIN, str(path), *args], env=environ,
                          capture_output=True, text=True, timeout=120)


def test_first_line_waits_for_nothing_heavy_and_debug_hooks_come_with_torch(tmp_path):
    # Importing these before the user's first line is launch overhead torchrun does not have
    # (benchmarks/launch_overhead.py); the watchdog's hooks still arrive with torch.
    result = _worker(tmp_path, FIRST_LINE, "a", MESHRUN_HANG_TIMEOUT="300")
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first == f"[] __main__ {tmp_path / 'script.py'} ['a']", result.stdout
    assert second == "hooks installed: True"


def test_a_raising_script_leaves_its_error_file(tmp_path):
    error_file = tmp_path / "error.json"
    result = _worker(tmp_path, "x = 1\nraise ValueError('bad batch')\n", TORCHELASTIC_ERROR_FILE=str(error_file))
    assert result.returncode == 1 and "ValueError: bad batch" in result.stderr
    assert "worker_main" not in result.stderr  # the bootstrap's own frames are not the user's
    record = json.loads(error_file.read_text())["meshrun"]
    assert (record["type"], record["text"], record["line"], record["rank"]) == ("ValueError", "bad batch", 2, "0")
    assert record["file"] == str(tmp_path / "script.py")
