"""Which workers fork from the pre-imported server (launch/preload.py), and how torch's agent is told.

The forked workers themselves run in tests/e2e/test_snapshot_resume.py (every start checked
single-threaded) and in every `meshrun train` test.
"""

from __future__ import annotations

import pytest

from meshrun.launch.args import build_parser
from meshrun.launch.launcher import WORKER_MAIN, build_launch
from meshrun.launch.preload import PRELOAD_MODULES, PRELOADED_TARGETS, preloaded_main
from meshrun.launch.spec import launch_spec

TRAIN = ["--nproc-per-node", "2", "-m", "meshrun.train.worker", "--run-dir", "r"]


def _plan(argv: list[str], environ: dict[str, str] | None = None):
    return launch_spec(build_parser().parse_args(argv), {"PATH": "/usr/bin", **(environ or {})})


def test_meshrun_train_workers_are_forked_from_the_preloaded_server(tmp_path):
    plan = _plan(TRAIN)
    assert plan.preload
    config, entry, args = build_launch(plan, str(tmp_path))
    assert entry is preloaded_main and config.start_method == "forkserver"
    assert args == ["-m", "meshrun.train.worker", "--run-dir", "r"]  # worker_main.run's argv; no -u
    assert "torch" in PRELOAD_MODULES and "meshrun.train.trainer" in PRELOAD_MODULES


def test_every_preloaded_name_is_a_module():
    """multiprocessing's forkserver skips a preload name that does not import, without a word:
    a renamed module would only make every restart slower. The names are strings, so check them."""
    import importlib.util

    from meshrun.testing.harness import PRELOAD

    missing = [name for name in (*PRELOAD_MODULES, *PRELOADED_TARGETS, *PRELOAD) if importlib.util.find_spec(name) is None]
    assert not missing, f"preloaded names that are not modules: {missing}"


@pytest.mark.parametrize("argv, environ", [
    (["--nproc-per-node", "2", "train.py"], {}),  # a user's script: its imports are its own
    (["--nproc-per-node", "2", "-m", "pkg.train"], {}),
    (TRAIN, {"OMP_NUM_THREADS": "4"}),  # torch's import would start OpenMP threads in the server
    (["--nproc-per-node", "1", *TRAIN[2:]], {}),  # one process: OMP_NUM_THREADS is not set to 1
    (TRAIN, {"MESHRUN_PRELOAD": "0"}),
])
def test_other_workers_are_started_as_before(tmp_path, argv, environ):
    plan = _plan(argv, environ)
    assert not plan.preload
    config, entry, args = build_launch(plan, str(tmp_path))
    assert isinstance(entry, str) and args[:2] == ["-u", WORKER_MAIN] and config.start_method != "forkserver"
