"""Output a person reads, through `meshrun launch` with real processes:
a user's error shows the user's frames without C++ stacks or meshrun's wrappers (all of it with
--verbose), Ctrl-C ends with one line (and stops `meshrun train` at once, with a checkpoint), and a plain torchrun-style script that creates and destroys
its own group runs cleanly under `--debug collectives`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from conftest import BIN, TINY, child_env, meshrun

from meshrun.testing.processes import group_members

USER_ERROR = """\
import torch
import torch.distributed as dist


def reduce_bits(t):
    dist.all_reduce(t, op=dist.ReduceOp.BXOR)  # floats have no BXOR: torch raises from C++


dist.init_process_group("gloo")
reduce_bits(torch.ones(2))
"""
# torch adds its C++ stack to the message when asked to; meshrun still leaves it out by default
CPP_ENV = {"TORCH_SHOW_CPP_STACKTRACES": "1", "TORCH_DISABLE_ADDR2LINE": "1", "OMP_NUM_THREADS": "1"}
WRAPPER_FRAME = re.compile(r'File "[^"]*/meshrun/[^"]*"')


def _user_error(tmp_path, *flags: str):
    script = tmp_path / "user_error.py"
    script.write_text(USER_ERROR)
    result = meshrun("launch", "--nproc-per-node", "1", *flags, str(script), timeout=90, env=CPP_ENV)
    assert result.returncode == 1, result.output
    return script, result.output


def test_a_users_error_shows_the_users_frames_only(tmp_path):
    script, out = _user_error(tmp_path)
    assert f'File "{script}", line 10, in <module>' in out and f'File "{script}", line 6, in reduce_bits' in out
    assert "RuntimeError: Cannot use ReduceOp.BXOR with non-integral dtype" in out, out
    assert not WRAPPER_FRAME.search(out), out
    assert "frame #" not in out and "C++ CapturedTraceback" not in out, out


def test_verbose_shows_every_frame(tmp_path):
    script, out = _user_error(tmp_path, "--verbose")
    assert f'File "{script}", line 6, in reduce_bits' in out
    assert WRAPPER_FRAME.search(out) and "C++ CapturedTraceback" in out, out


LOOP = """\
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
open(sys.argv[1] + os.environ["RANK"], "w").close()
while True:
    dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
"""


def test_ctrl_c_ends_with_one_line(tmp_path):
    script, ready = tmp_path / "loop.py", tmp_path / "ready-"
    script.write_text(LOOP)
    proc = subprocess.Popen([str(BIN / "meshrun"), "launch", "--nproc-per-node", "2", str(script), str(ready)],
                            env=child_env({"OMP_NUM_THREADS": "1"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not all(os.path.exists(f"{ready}{r}") for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    ours = [line for line in err.splitlines() if "meshrun" in line]
    assert len(ours) == 1 and "stopped by SIGINT" in ours[0], err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


# torch's agent waits this long for stopped workers to exit before it SIGKILLs them
# (MultiprocessContext._close). Forked workers that had saved and returned used to wait that
# long for the agent's "result read" event (a stopped worker now exits at once: launch/preload.py stopped_by_agent).
TORCH_CLOSE_TIMEOUT_S = 30


def test_ctrl_c_stops_meshrun_train_with_a_checkpoint_well_before_torchs_kill(tmp_path):
    """Ctrl-C in the middle of `meshrun train`: the workers save, return and exit by themselves
    (1.6 s here), nothing is left running, and the command says how to continue."""
    from conftest import TINY

    proc = subprocess.Popen([str(BIN / "meshrun"), "train", TINY, "--set", "train.name=stop",
                             "--set", f"train.run_dir={tmp_path}", "--set", "train.steps=100000",
                             "--set", "train.eval_interval=0"],
                            cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        metrics = tmp_path / "stop" / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        _, err = proc.communicate(timeout=TORCH_CLOSE_TIMEOUT_S - 10)  # a timeout fails the test
        gone_by = time.monotonic() + 5  # multiprocessing's resource tracker exits once its pipe closes
        while group_members(proc.pid) and time.monotonic() < gone_by:
            time.sleep(0.05)
        left = group_members(proc.pid)
    finally:
        if proc.poll() is None or group_members(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    assert "checkpoint committed; re-run the same command to continue" in err, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not left, f"processes of the job outlived it: {left}"


PLAIN = """\
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
if dist.get_rank() == 1:
    time.sleep(2)  # rank 0 has destroyed its group (and the store it served) meanwhile
print("rank", dist.get_rank(), "sum", t.sum().item(), flush=True)
dist.destroy_process_group()
"""


def test_debug_collectives_runs_a_plain_script_cleanly(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    result = meshrun("launch", "--nproc-per-node", "2", "--debug", "collectives", str(script), timeout=90,
                     env={"OMP_NUM_THREADS": "1"})
    out = result.output
    assert result.returncode == 0, out
    assert "[rank 0] rank 0 sum 32.0" in out and "[rank 1] rank 1 sum 32.0" in out, out
    assert "DistNetworkError" not in out and "frame #" not in out and "Traceback" not in out, out


def test_a_reader_that_leaves_early_is_no_error():
    """`meshrun config show ... | true`: the reader is gone before meshrun prints; exit 0 and no
    traceback (BrokenPipeError is an OSError, whose own branch once re-raised it)."""
    proc = subprocess.run(["bash", "-c", f'"{BIN / "meshrun"}" config show "$0" | true; echo "exit=${{PIPESTATUS[0]}}"',
                           TINY], env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "exit=0" and "Traceback" not in proc.stderr, (proc.stdout, proc.stderr)
