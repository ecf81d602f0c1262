"""Pure logic behind what a person reads of a failure (debug/readable.py),
whom `meshrun diagnose` blames for a consequence, meshrun's own worker errors, and the hang
report's list of ranks not in a collective."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

from conftest import rank_log_dir

from meshrun.debug.readable import MESHRUN_DIR, format_exception, readable_lines, strip_cpp
from meshrun.debug.watchdog import absent_ranks
from meshrun.diagnose.postmortem import diagnose, format_diagnosis

CPP_MESSAGE = (
    "Cannot use ReduceOp.BXOR with non-integral dtype\n"
    "Exception raised from toFunction at /__w/pytorch/ProcessGroupGlooDetail.hpp:139 (most recent call first):\n"
    "C++ CapturedTraceback:\n#4 ?? from libc10.so:700674\n#5 c10::Error::Error(c10::SourceLocation) from libc10.so\n"
)


def test_the_cpp_stack_is_cut_from_a_message_and_from_log_lines():
    assert strip_cpp(CPP_MESSAGE) == "Cannot use ReduceOp.BXOR with non-integral dtype"
    log = ["[W TCPStore.cpp:125] recvValue failed", "Exception raised from recvBytes at Utils.hpp:787 (most recent "
           "call first):", "frame #0: c10::Error::Error() + 0x9d", "<omitting python frames>", "frame #15: + 0x891f5",
           "", "Traceback (most recent call last):", f'  File "{MESHRUN_DIR}debug/stacks.py", line 3 in dump',
           '  File "/home/u/train.py", line 9 in main']
    assert readable_lines(log) == ["[W TCPStore.cpp:125] recvValue failed", "Traceback (most recent call last):",
                                   '  File "/home/u/train.py", line 9 in main']


def _raise_through(wrapper_file: str, user_file: str):
    """An exception raised in 'user code' that passed through a frame compiled as `wrapper_file`."""
    namespace: dict = {}
    exec(compile("def wrapper(f):\n    return f()\n", wrapper_file, "exec"), namespace)
    exec(compile(f"def user():\n    raise RuntimeError({CPP_MESSAGE!r})\n", user_file, "exec"), namespace)
    try:
        namespace["wrapper"](namespace["user"])
    except RuntimeError as exc:
        return exc
    raise AssertionError("did not raise")


def test_a_users_traceback_loses_meshrun_frames_and_cpp_unless_full(tmp_path):
    exc = _raise_through(f"{MESHRUN_DIR}debug/collectives.py", str(tmp_path / "train.py"))
    tb = exc.__traceback__.tb_next  # from the wrapper on: this test's own frame is not the story
    short = format_exception(exc, tb)
    assert "collectives.py" not in short and "train.py" in short and "CapturedTraceback" not in short
    assert short.endswith("RuntimeError: Cannot use ReduceOp.BXOR with non-integral dtype\n")
    full = format_exception(exc, tb, full=True)
    assert full == "".join(traceback.format_exception(type(exc), exc, tb))
    assert "collectives.py" in full and "CapturedTraceback" in full
    # with no user frame at all (meshrun train), meshrun's frames are the program: they stay
    own = _raise_through(f"{MESHRUN_DIR}train/loop.py", f"{MESHRUN_DIR}models/build.py")
    assert "loop.py" in format_exception(own, own.__traceback__.tb_next)


def _agent(logs: Path, rows: list[tuple[int, int, Path]]) -> None:
    (logs / "failures.json").write_text(json.dumps({"failures": [
        {"rank": r, "local_rank": r, "exitcode": code, "time": 100.0 + r, "log_dir": str(d)} for r, code, d in rows]}))


def test_diagnose_names_the_rank_a_consequence_comes_from(tmp_path):
    logs = tmp_path / "logs"
    d0 = rank_log_dir(logs, 0)  # finished and left: no error, no agent record
    d1 = rank_log_dir(logs, 1, error={"time": 101.0, "type": "DistNetworkError", "text": "Connection reset by peer",
                                   "file": "t.py", "line": 3, "function": "f", "rank": "1"})
    _agent(logs, [(1, 1, d1)])
    diag = diagnose(str(logs))
    assert diag.first.rank == 1 and diag.first.kind == "consequence of another rank's failure"
    assert diag.first.fix.startswith("rank 0 caused this: it recorded no error"), diag.first.fix
    assert str(d0) in diag.first.fix and "fix: rank 0 caused this" in format_diagnosis(diag)


def test_diagnose_blames_the_rank_the_report_names(tmp_path):
    logs = tmp_path / "logs"
    text = ("hang watchdog: no rank made progress for 5s (--hang-timeout); rank 0 is waiting in all_reduce #1 at "
            "t.py:9 in <module> for a peer; not in a collective: rank 2 (stalled in user code at t.py:4 in load)")
    d0 = rank_log_dir(logs, 0, error={"time": 100.0, "type": "HangDetected", "text": text, "rank": "0"})
    d1, d2 = rank_log_dir(logs, 1), rank_log_dir(logs, 2)
    _agent(logs, [(0, 124, d0), (1, -15, d1), (2, -15, d2)])
    diag = diagnose(str(logs))
    assert diag.first.fix.startswith("rank 2 caused this"), diag.first.fix


def test_a_workers_meshrun_error_is_read_and_classified(tmp_path):
    logs = tmp_path / "logs"
    line = "meshrun train: error: model.factory='os:getcwd' returned str, not a torch.nn.Module"
    d0 = rank_log_dir(logs, 0, stderr=f"{line}\n")
    _agent(logs, [(0, 2, d0)])
    diag = diagnose(str(logs))
    assert diag.first.exc_type == "MeshrunError" and "model.factory='os:getcwd'" in diag.first.exc_text
    assert diag.first.kind == "refused by meshrun"
    assert "model.factory='os:getcwd' returned str" in format_diagnosis(diag)


def test_the_hang_report_names_the_ranks_outside_the_collective():
    states = {0: {"state": "collective", "where": "waiting in all_reduce #1"},
              1: {"state": "user", "where": "stalled in user code at t.py:6 in load_data"}}
    assert absent_ranks(states, []) == "not in a collective: rank 1 (stalled in user code at t.py:6 in load_data)"
    assert absent_ranks({r: {"state": "user", "where": "x"} for r in (0, 1)}, []) == ""  # nobody waits
    line = absent_ranks({0: states[0]}, [1], asked=[1])
    assert line.startswith("not in a collective and not answering: rank 1") and "asked for by signal" in line
