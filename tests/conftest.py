"""Shared fixtures: run meshrun's CLI and scripts as real processes, always bounded and reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
BIN = Path(sys.executable).parent


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_proc(cmd: list[str], *, timeout: float = 120, cwd: Path | str | None = None,
             env: dict[str, str] | None = None) -> Result:
    """Run cmd in its own session; on timeout kill the whole group (by id) and fail the test."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                  "MASTER_ADDR", "MASTER_PORT")}
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return Result(proc.returncode, out, err)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fp:
                    ppid = int(fp.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, by pid (workers run in sessions of their own)."""
    for target in [pid, *_descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def meshrun(*args: str, **kwargs) -> Result:
    """`meshrun ARGS...` through the installed console script."""
    return run_proc([str(BIN / "meshrun"), *args], **kwargs)


@pytest.fixture
def write_script(tmp_path: Path):
    """write_script("name.py", source) -> path of a script in this test's temp dir."""

    def _write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(source)
        return path

    return _write
