"""Processes a rank starts end with the job (launch/leftovers.py), on success and on failure.

Each rank starts a child that ignores SIGTERM and would sleep for ten minutes, then exits: with
torch's agent alone the child outlives the job. Through `meshrun launch` (exec'd workers) and
`meshrun train` (workers forked from the preloaded server, the child started by a model factory),
no such child runs once the command has returned, and stderr names each one it stopped.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import meshrun, train_tiny

from meshrun.launch.leftovers import running

# The child writes its pid to $LEFTOVER_DIR/<pid> once it ignores SIGTERM; the rank waits for it.
START_CHILD = """\
import os, subprocess, sys, time

def start_stubborn_child():
    out = os.environ["LEFTOVER_DIR"]
    code = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"open(os.path.join({out!r}, str(os.getpid())), 'w').close(); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, str(child.pid))) and time.monotonic() < deadline:
        time.sleep(0.02)
    return child
"""

# Every rank's child is up before any rank exits: a rank that exits 3 first would have the agent
# stop the other before its child started (seen under load: one child recorded of two).
SCRIPT = START_CHILD + """
start_stubborn_child()
out, ranks = os.environ["LEFTOVER_DIR"], int(os.environ["LOCAL_WORLD_SIZE"])
deadline = time.monotonic() + 60
while sum(name.isdigit() for name in os.listdir(out)) < ranks and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(int(sys.argv[1]))
"""

FACTORY = START_CHILD + """
from torch import nn


class Bigram(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 16)
        self.out = nn.Linear(16, vocab_size)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


def build(model_cfg, vocab_size):
    if "RANK" in os.environ:  # a worker, not the launcher's check of the factory
        start_stubborn_child()
    return Bigram(vocab_size)
"""


def _children(directory: Path) -> list[int]:
    return [int(p.name) for p in directory.iterdir() if p.name.isdigit()]


def _assert_none_left(directory: Path, stderr: str, ranks: int) -> None:
    children = _children(directory)
    assert len(children) >= ranks, (children, stderr)  # a factory may build twice on a rank
    try:
        left = [pid for pid in children if running(pid)]
        assert not left, f"children outlived the job: {left}\n{stderr}"
        for pid in children:
            assert f"left process {pid} running" in stderr, stderr
    finally:
        for pid in children:  # never leave them behind, whatever failed
            if running(pid):
                os.kill(pid, 9)


@pytest.mark.parametrize("code", [0, 3], ids=["success", "failure"])
def test_a_launched_scripts_stubborn_children_end_with_the_job(tmp_path, code):
    script = tmp_path / "spawner.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    result = meshrun("launch", "--nproc-per-node", "2", str(script), str(code), timeout=120,
                     env={"LEFTOVER_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert result.returncode == code, result.output
    _assert_none_left(tmp_path, result.stderr, 2)
    print(f"launch ({'exit ' + str(code)}): {time.monotonic() - started:.1f} s with its children stopped")


def test_meshrun_trains_stubborn_children_end_with_the_run(tmp_path):
    (tmp_path / "spawning_models.py").write_text(FACTORY)
    children = tmp_path / "children"
    children.mkdir()
    result, _ = train_tiny(tmp_path, "spawner", "--set", "model.factory=spawning_models:build",
                           "--set", "train.steps=3", "--set", "train.eval_interval=0",
                           env={"LEFTOVER_DIR": str(children)})
    assert result.returncode == 0, result.output
    _assert_none_left(children, result.stderr, 2)
