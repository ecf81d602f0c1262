"""Where this process is: every thread's Python stack (py-spy when installed, else faulthandler)."""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
import sys
import threading


def dump_all_threads(out=None) -> str:
    """Write every thread's stack to `out` (stderr); return which tool did it."""
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
    faulthandler.dump_traceback(file=out, all_threads=True)
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
