"""The per-attempt failure notice: which rank ended an attempt, printed and kept in failures.log."""

from __future__ import annotations

import io
import json
import logging

from meshrun.launch.attempts import FAILURES_FILE, AttemptRecorder

AGENT_MSG = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"


def _error_file(path, rank: int, exc_type: str, text: str, line: int) -> None:
    path.mkdir(parents=True)
    data = {"message": {"message": f"{exc_type}: {text}"},
            "meshrun": {"time": 100.0 + rank, "type": exc_type, "text": text, "file": "train.py",
                        "line": line, "function": "<module>", "rank": str(rank)}}
    (path / "error.json").write_text(json.dumps(data))


def _emit(recorder: AttemptRecorder, exitcode: int, local_rank: int, pid: int = 42) -> None:
    record = logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, __file__, 1,
                               AGENT_MSG, (exitcode, local_rank, pid, "python"), None)
    recorder.emit(record)


def test_exception_then_sigterm_is_named_as_the_cause_not_a_consequence(tmp_path):
    attempt = tmp_path / "run_x" / "attempt_0"
    _error_file(attempt / "1", 1, "RuntimeError", "injected crash", 9)
    _error_file(attempt / "0", 0, "RuntimeError", "Connection closed by peer [127.0.0.1]:1", 12)
    out = io.StringIO()
    recorder = AttemptRecorder(str(tmp_path), max_restarts=3, stream=out)
    _emit(recorder, -15, 1)  # the agent stopped rank 1 while it was exiting after raising
    line = out.getvalue().strip()
    assert line.startswith("meshrun: attempt 0 failed on ")
    assert "rank 1 (local rank 1, pid 42): RuntimeError: injected crash at train.py:9" in line
    assert "consequence" not in line and line.endswith("restarting (restart 1 of --max-restarts 3)")
    record = (tmp_path / FAILURES_FILE).read_text()
    assert "attempt 0 failed" in record and "then rank 0 (local rank 0): RuntimeError: Connection closed" in record


def test_sigkill_without_error_file_and_last_attempt_is_only_filed(tmp_path):
    (tmp_path / "run_x" / "attempt_0" / "0").mkdir(parents=True)
    (tmp_path / "run_x" / "attempt_1" / "0").mkdir(parents=True)
    out = io.StringIO()
    recorder = AttemptRecorder(str(tmp_path), max_restarts=1, stream=out)
    _emit(recorder, -9, 0, pid=7)
    assert "meshrun: attempt 1 failed on" in out.getvalue()  # the newest attempt is the one that died
    assert "local rank 0 (pid 7): killed by SIGKILL; restarting (restart 1 of --max-restarts 1)" in out.getvalue()
    _emit(recorder, -9, 0, pid=8)  # out of restarts: the failure summary follows, so only the file
    assert out.getvalue().count("meshrun: attempt") == 1
    assert "no restarts left" in (tmp_path / FAILURES_FILE).read_text()


def test_other_agent_records_are_ignored(tmp_path):
    out = io.StringIO()
    recorder = AttemptRecorder(str(tmp_path), max_restarts=3, stream=out)
    recorder.emit(logging.LogRecord("x", logging.ERROR, __file__, 1, "Process %s did not exit", (1,), None))
    assert out.getvalue() == "" and not (tmp_path / FAILURES_FILE).exists()


def test_peer_picked_first_points_at_the_rank_that_left_no_error(tmp_path):
    attempt = tmp_path / "run_x" / "attempt_0"
    _error_file(attempt / "0", 0, "RuntimeError", "Read error: Connection reset by peer", 12)
    (attempt / "1").mkdir()  # SIGKILLed: no error file
    out = io.StringIO()
    _emit(AttemptRecorder(str(tmp_path), max_restarts=3, stream=out), 1, 0)
    assert "failed on" in out.getvalue() and "local rank 1 ended without a Python error" in out.getvalue()


def test_a_log_dir_shared_with_another_node_uses_this_agents_run(tmp_path):
    ours, theirs = tmp_path / "job_ours", tmp_path / "job_theirs"
    _error_file(ours / "attempt_0" / "0", 0, "ValueError", "ours", 3)
    _error_file(theirs / "attempt_0" / "0", 2, "KeyError", "theirs", 4)  # written last: the newest
    out = io.StringIO()

    class Specs:
        _run_log_dir = str(ours)

    _emit(AttemptRecorder(str(tmp_path), max_restarts=3, stream=out, logs_specs=Specs()), 1, 0)
    assert "ValueError: ours" in out.getvalue()
