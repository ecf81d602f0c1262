"""Failure attribution: the rank that failed on its own leads; peers' follow-on errors follow."""

from __future__ import annotations

import json
from types import SimpleNamespace

from meshrun.launch.summary import (
    RankFailure,
    collect_failures,
    format_summary,
    is_follow_on,
    order_by_cause,
)


def _failure(rank, exitcode=1, time=100.0, exc=None, text=""):
    return RankFailure(rank=rank, local_rank=rank, pid=1000 + rank, exitcode=exitcode, time=time,
                       exc_type=exc, exc_text=text)


def test_follow_on_errors_are_recognized():
    assert is_follow_on(_failure(0, exc="RuntimeError", text="[pair.cc:553] Connection closed by peer"))
    assert is_follow_on(_failure(0, exc="RuntimeError", text="Read error: Connection reset by peer"))
    assert is_follow_on(_failure(0, exitcode=-15))  # stopped by the agent
    assert not is_follow_on(_failure(1, exc="ValueError", text="bad batch"))
    assert not is_follow_on(_failure(1, exitcode=-9))  # SIGKILL: OOM killer or the user
    # SIGTERMed by the agent while still exiting from its own exception: that rank is a root cause
    assert not is_follow_on(_failure(1, exitcode=-15, exc="ValueError", text="bad batch"))
    assert is_follow_on(_failure(1, exitcode=-15, exc="KeyboardInterrupt"))


def test_root_cause_leads_even_when_a_follow_on_was_earlier():
    root = _failure(1, exitcode=-9, time=101.0)
    follow = _failure(0, time=100.5, exc="RuntimeError", text="Connection reset by peer")
    for f in (root, follow):
        f.follow_on = is_follow_on(f)
    ordered = order_by_cause([follow, root])
    assert [f.rank for f in ordered] == [1, 0]
    text = format_summary(ordered, "/tmp/logs")
    assert "Rank 1 failed first" in text and "SIGKILL" in text
    assert "as a consequence" in text and "rank 0" in text


def test_earliest_of_several_root_causes_leads():
    a, b = _failure(2, time=105.0, exc="KeyError"), _failure(3, time=104.0, exc="ValueError")
    assert [f.rank for f in order_by_cause([a, b])] == [3, 2]


def test_shell_exit_codes():
    assert _failure(0, exitcode=-9).shell_exit_code == 137
    assert _failure(0, exitcode=3).shell_exit_code == 3


def test_collect_reads_error_files_and_rank_logs(tmp_path):
    rank_dir = tmp_path / "run_x" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stderr.log").write_text("Traceback...\nValueError: boom\n")
    (rank_dir / "stdout.log").write_text("step 1\nstep 2\n")
    error_file = rank_dir / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "ValueError: boom", "extraInfo": {
        "py_callstack": 'File "/x/train.py", line 7, in main\n', "timestamp": "100"}}}))
    pf = SimpleNamespace(local_rank=1, pid=42, exitcode=1, timestamp=100, error_file=str(error_file))
    failures = collect_failures(SimpleNamespace(failures={1: pf}), str(tmp_path))
    (f,) = failures
    assert (f.exc_type, f.exc_text, f.site) == ("ValueError", "boom", "/x/train.py:7 in main")
    assert f.stdout_tail == ["step 1", "step 2"] and f.tail[-1] == "ValueError: boom"
    assert f.log_dir == str(rank_dir)
