"""`meshrun`'s quick exit (cli/__init__.py quick_exit): what a normal exit does, less torch's teardown."""

from __future__ import annotations

import sys

from conftest import run_proc

PROBE = r"""
import atexit, sys, threading, time
import torch
from meshrun.cli import quick_exit

left_open = open(sys.argv[1], "w")  # written, never closed: a normal exit's finalizer flushes it
left_open.write("every byte")
atexit.register(print, "atexit ran", flush=True)


class Teardown:  # freed only by the interpreter's teardown: the quick exit skips it
    def __del__(self):
        print("torn down", flush=True)


kept = Teardown()
if sys.argv[2] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished", flush=True))).start()
print("buffered line", end="")
quick_exit(7)
"""


def test_quick_exit_keeps_the_exit_code_the_atexit_handlers_and_every_byte(tmp_path):
    out = tmp_path / "out.txt"
    result = run_proc([sys.executable, "-c", PROBE, str(out), "none"], timeout=120)
    assert result.returncode == 7, result.output
    assert out.read_text() == "every byte"
    assert "atexit ran" in result.stdout and "buffered line" in result.stdout, result.output
    assert "torn down" not in result.stdout, result.output  # the teardown was skipped


def test_a_running_thread_gets_the_normal_exit(tmp_path):
    """A non-daemon thread still running is joined, as Python's own exit would."""
    out = tmp_path / "out.txt"
    result = run_proc([sys.executable, "-c", PROBE, str(out), "thread"], timeout=120)
    assert result.returncode == 7, result.output
    assert "thread finished" in result.stdout and out.read_text() == "every byte", result.output
    assert "torn down" in result.stdout, result.output  # Python's own exit
