"""Where this process is: every thread's Python stack (py-spy when installed, else faulthandler).

A worker with the hang watchdog on also dumps its stacks on STACK_SIGNAL (faulthandler, set up
by the launch bootstrap before the user's first line, a C handler that works in any state), so a rank whose own watchdog is not
running (stuck before it imported torch) can still be asked where it is by a peer on its host.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

STACK_SIGNAL = signal.SIGUSR2  # launch/worker_main.py registers faulthandler on it (the same number)


def local_workers(ranks: list[int]) -> dict[int, int]:
    """{rank: pid} of this process's sibling workers (same parent: the agent) with those RANKs."""
    wanted, found = {str(r) for r in ranks}, {}
    parent, me = os.getppid(), os.getpid()
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit() and int(e) != me]
    except OSError:
        return {}
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as fp:
                if int(fp.read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as fp:
                env = fp.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
        if rank in wanted:
            found[int(rank)] = int(entry)
    return found


def signal_local_ranks(ranks: list[int], out=None) -> list[int]:
    """Ask those ranks that run on this host for their stacks (STACK_SIGNAL); return the ranks asked."""
    out = out or sys.stderr
    asked = []
    for rank, pid in sorted(local_workers(ranks).items()):
        try:
            os.kill(pid, STACK_SIGNAL)
            asked.append(rank)
        except OSError:
            pass
    if asked:
        print(f"meshrun: asked rank {', '.join(map(str, asked))} for its Python stack ({STACK_SIGNAL.name}, "
              "faulthandler): it follows in that rank's output", file=out)
        time.sleep(0.5)  # the dump is written by a signal handler at once; let it reach the log
    return asked


def dump_all_threads(out=None) -> str:
    """Write every thread's stack to `out` (stderr); return which tool did it."""
    import shutil
    import subprocess

    out = out or sys.stderr
    out.flush()
    py_spy = shutil.which("py-spy")
    if py_spy:
        try:
            done = subprocess.run([py_spy, "dump", "--pid", str(os.getpid())], capture_output=True,
                                  text=True, timeout=15)
            if done.returncode == 0 and done.stdout.strip():
                out.write(done.stdout)
                out.flush()
                return "py-spy"
        except (OSError, subprocess.SubprocessError):
            pass
    import tempfile

    from meshrun.debug.readable import readable_lines, verbose

    with tempfile.TemporaryFile("w+") as dump:  # faulthandler writes to a file descriptor
        faulthandler.dump_traceback(file=dump, all_threads=True)
        dump.seek(0)
        text = dump.read()
    if not verbose():  # the calling thread (meshrun's own) and meshrun's frames say nothing of the user's code
        blocks = [b for b in text.split("\n\n") if b.strip() and not b.startswith("Current thread")]
        text = "\n\n".join("\n".join(readable_lines(b.splitlines())) for b in blocks) + "\n"
    out.write(text)
    out.flush()
    return "faulthandler"


def main_thread_site(skip_dirs: tuple[str, ...]) -> tuple[str, bool]:
    """(`file:line in function` of the main thread's innermost user frame, whether it is inside torch)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    innermost_in_torch = False
    first = True
    while frame is not None:
        path = frame.f_code.co_filename
        if first:
            innermost_in_torch = "torch" + os.sep in path
            first = False
        if not path.startswith(skip_dirs) and not path.startswith("<"):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}", innermost_in_torch
        frame = frame.f_back
    return "<unknown>", innermost_in_torch
