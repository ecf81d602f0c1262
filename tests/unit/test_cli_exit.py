"""`meshrun`'s quick exit (cli/__init__.py quick_exit): what a normal exit does, less torch's teardown."""

from __future__ import annotations

import sys

import pytest
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
if sys.argv[2] == "frozen":  # as in a process forked from a server that froze its heap (tests/warm_cli.py)
    import gc

    gc.freeze()
quick_exit(7)
"""


@pytest.mark.parametrize("heap", ["none", "frozen"])
def test_quick_exit_keeps_the_exit_code_the_atexit_handlers_and_every_byte(tmp_path, heap):
    """`frozen`: the open file and the streams are out of gc.get_objects' sight until unfrozen."""
    out = tmp_path / "out.txt"
    result = run_proc([sys.executable, "-c", PROBE, str(out), heap], timeout=120)
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


def _interrupted_before_meshrun_ran(returncode: int, err: str) -> bool:
    """Whether a SIGINT reached the process before any function of meshrun's had started: killed
    before Python installed its handler (silent), or a KeyboardInterrupt (fatal in the interpreter's
    own set-up, raised, or printed and ignored by importlib) in which meshrun's frames, if any, are
    module bodies only. Once meshrun's entry function runs, a KeyboardInterrupt there shows its frame."""
    import os
    import re
    import signal

    import meshrun

    if returncode == -signal.SIGINT and not err.strip():
        return True
    if returncode == 1 and "Fatal Python error: init_" in err:  # init_import_site, init_sys_streams...
        return True
    if "KeyboardInterrupt" not in err:
        return False
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', err)
    package = os.path.dirname(meshrun.__file__) + os.sep
    ours = [func for path, func in frames if path.startswith(package) or path.endswith("/bin/meshrun")]
    return all(func == "<module>" for func in ours)


def test_interrupts_before_meshrun_ran_are_told_apart_from_meshruns_own():
    """The classifier above: a traceback inside a function of meshrun's is never left out."""
    import os
    import signal

    import meshrun

    init = os.path.abspath(meshrun.__file__)
    at_import = ('Traceback (most recent call last):\n  File "/v/bin/meshrun", line 5, in <module>\n'
                 f'    from meshrun.cli import run\n  File "{init}", line 18, in <module>\n'
                 '  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load\nKeyboardInterrupt\n')
    assert _interrupted_before_meshrun_ran(-signal.SIGINT, at_import)
    assert _interrupted_before_meshrun_ran(1, "Fatal Python error: init_import_site: Failed to import site\n")
    assert _interrupted_before_meshrun_ran(0, 'Exception ignored in: <function cb>\nTraceback (most recent call'
                                              ' last):\n  File "<frozen importlib._bootstrap>", line 207, in cb\n'
                                              'KeyboardInterrupt: \nmeshrun train: run directory runs/x\n')
    in_typing = at_import.replace('KeyboardInterrupt', '  File "/py/typing.py", line 2052, in __init_subclass__'
                                  '\nKeyboardInterrupt')
    assert _interrupted_before_meshrun_ran(-signal.SIGINT, in_typing)
    in_main = at_import.replace('line 18, in <module>', 'line 140, in main')
    assert not _interrupted_before_meshrun_ran(-signal.SIGINT, in_main)
    assert not _interrupted_before_meshrun_ran(130, "meshrun train: interrupted (Ctrl-C)\n")
    assert _interrupted_before_meshrun_ran(-signal.SIGINT, "")  # the signal's default action: no Python yet
    assert not _interrupted_before_meshrun_ran(1, "")
    assert _interrupted_before_meshrun_ran(1, "KeyboardInterrupt\n")  # inside the interpreter's own set-up


def test_ctrl_c_during_start_up_is_one_line_and_exit_130_at_every_moment(tmp_path):
    """SIGINT to the whole group (a terminal's Ctrl-C) while `meshrun train` imports and checks:
    one line, exit 130, at once, nothing left running. A KeyboardInterrupt raised there landed in
    an import (a traceback, exit 1 after 9 s) or was swallowed and the run went on to finish."""
    import os
    import signal
    import subprocess
    import time

    from conftest import BIN, TINY, child_env

    from meshrun.testing.processes import group_members, kill_tree

    # Before meshrun's entry function runs, a SIGINT is Python's, for any Python program: it kills
    # silently, ends the interpreter's set-up ("Fatal Python error: init_...", exit 1), is printed and
    # ignored (the run goes on), or raises in the console script's module-level imports. Nothing there
    # is meshrun's to catch. On a loaded machine a 0.1 s Ctrl-C lands there (seen in fresh-clone suite
    # runs); such a moment is left out, and most moments must reach meshrun.
    delays, in_python_start_up = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8), []
    for delay in delays:
        proc = subprocess.Popen([str(BIN / "meshrun"), "train", TINY, "--set", "train.steps=2",
                                 "--set", f"train.run_dir={tmp_path}", "--set", "train.name=ctrl_c"],
                                cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            time.sleep(delay)
            os.killpg(proc.pid, signal.SIGINT)
            _, err = proc.communicate(timeout=20)
            left = time.monotonic() + 5
            while group_members(proc.pid) and time.monotonic() < left:
                time.sleep(0.05)
            assert not group_members(proc.pid), f"Ctrl-C after {delay} s: left running {group_members(proc.pid)}"
        finally:
            kill_tree(proc.pid)
            if proc.poll() is None:
                proc.communicate()
        where = f"Ctrl-C after {delay} s: exit {proc.returncode}\n{err}"
        if _interrupted_before_meshrun_ran(proc.returncode, err):
            in_python_start_up.append(delay)
            continue
        lines = err.strip().splitlines()
        assert proc.returncode == 130 and len(lines) == 1 and lines[0].startswith("meshrun train: interrupted"), where
    assert len(in_python_start_up) <= len(delays) // 2, f"Ctrl-C landed in Python's start-up after {in_python_start_up} s"
