"""Every test file in the repository is collected by a plain `pytest`, as `make test` runs it.

pytest silently skips folders it considers build output (its default norecursedirs holds `dist`,
`build`, `*.egg`, dot-folders...), and a file it cannot import is an error that a narrow run never
sees; tests/dist went uncollected that way, 28 tests that never ran. This runs the same collection
as `make test` and compares it with the test files on disk: when this session collected what a plain
`pytest` collects (no paths: `make test`'s -m only deselects, after collection), its own items and
the ones it deselected, which cost nothing; otherwise (a narrow run of this file) `pytest
--collect-only` in a subprocess (10 CPU-s on this machine, quiet).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DESELECTED, REPO, child_env

# Folders that hold no project tests: virtual environments and caches anywhere, and packaging or run
# outputs at the top only (a tests/dist or tests/build folder is exactly what this test must catch).
SKIP_ANYWHERE = {"venv", "node_modules", "__pycache__"}
SKIP_AT_TOP = {"build", "dist", "runs"}


def _test_files_on_disk() -> set[str]:
    found = set()
    for root, dirs, files in os.walk(REPO):
        top = Path(root) == REPO
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d in SKIP_ANYWHERE or d.endswith(".egg-info")
                                           or (top and d in SKIP_AT_TOP))]
        rel = Path(root).relative_to(REPO)
        for name in files:
            if name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")):
                found.add((rel / name).as_posix())
    return found


def _whole_session(config) -> bool:
    """Whether this session collected what a plain `pytest` collects: no paths, run from the
    repository (a collection error would already have stopped it). -m, -k and --deselect leave
    out tests after they are collected (conftest.DESELECTED lists them); --ignore and
    --last-failed skip files."""
    option = config.option
    return (not getattr(option, "file_or_dir", None) and not getattr(option, "ignore", None)
            and not getattr(option, "ignore_glob", None) and not getattr(option, "lf", False)
            and Path(config.rootpath) == REPO and os.environ.get("PYTEST_ADDOPTS", "") == "")


def _collected_by_a_plain_pytest() -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=REPO, env=child_env({"PYTEST_ADDOPTS": ""}), capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, f"collection failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr}"
    return {line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line}


@pytest.mark.timeout(180)
def test_plain_pytest_collects_every_test_file(request):
    if _whole_session(request.config):
        collected = {nodeid.split("::", 1)[0] for nodeid in
                     (*(item.nodeid for item in request.session.items), *DESELECTED)}
    else:
        collected = _collected_by_a_plain_pytest()
    on_disk = _test_files_on_disk()
    assert len(on_disk) > 30, on_disk  # the walk itself found the suite
    assert "tests/unit/test_suite_collects.py" in collected
    missing = sorted(on_disk - collected)
    assert not missing, f"test files a plain `pytest` never collects (no test in them runs in CI): {missing}"
    distributed = [f for f in collected if f.startswith("tests/distributed/")]
    assert len(distributed) >= 5, distributed


def test_make_test_runs_both_phases():
    """`make test` runs the suite without the tests marked `alone`, then those by themselves: dropping
    either phase drops tests from CI (the Ray cluster's) without a collection error to show it."""
    import re

    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe, "Makefile has no test recipe"
    body = recipe.group(1)
    assert re.search(r'pytest -n \$\(TEST_WORKERS\) --dist loadfile -m "not alone"', body), body
    assert re.search(r"pytest -m alone", body), body
    assert "exit $$rc2" in body, body  # a failure in the second phase fails `make test`
