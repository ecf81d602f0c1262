"""The worker bootstrap (launch/worker_main.py): what a script's first line waits for, and what
a failure leaves behind. Real processes, no launcher: the bootstrap is run as the agent runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


MAIN_STATE = """\
import json, sys
print(json.dumps({"argv": sys.argv, "file": __file__, "loader": type(__loader__).__name__,
                  "package": __package__, "builtins": type(__builtins__).__name__, "path0": sys.path[0],
                  "names": sorted(k for k in globals() if k.startswith("__"))}))
"""


def _zipapp(directory, source: str):
    import zipapp

    (directory / "app").mkdir()
    (directory / "app" / "__main__.py").write_text(source)
    zipapp.create_archive(directory / "app", directory / "app.pyz")
    return "app.pyz"


@pytest.mark.parametrize("layout", ["symlink", "no_extension", "zipapp"])
def test_main_is_what_python_makes_of_the_target(tmp_path, layout):
    # `python target` is the reference (torchrun runs it): a symlinked script's sys.path[0] is its
    # real directory, a script without .py is still source, a zip application is first on sys.path.
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "main.py").write_text(MAIN_STATE)
    if layout == "symlink":
        (tmp_path / "link.py").symlink_to(tmp_path / "real" / "main.py")
        target = "link.py"
    elif layout == "no_extension":
        (tmp_path / "main").write_text(MAIN_STATE)
        target = "main"
    else:
        target = _zipapp(tmp_path, MAIN_STATE)
    env = {"PATH": "/usr/bin:/bin"}
    run = lambda *cmd: subprocess.run([sys.executable, *cmd, target, "x"], env=env, cwd=tmp_path,  # noqa: E731
                                      capture_output=True, text=True, timeout=60)
    plain, ours = run(), run("-u", WORKER_MAIN)
    assert plain.returncode == 0 and ours.returncode == 0, plain.stderr + ours.stderr
    expected, got = json.loads(plain.stdout), json.loads(ours.stdout)
    if layout == "zipapp":  # runpy runs it, and names it by its absolute path in sys.argv[0] meanwhile
        assert got["argv"] == [str(tmp_path.resolve() / target), "x"]
        got["argv"] = expected["argv"]
    assert got == expected
