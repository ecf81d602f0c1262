"""Failure attribution: the rank that failed on its own, or left first, leads; peers' follow-on errors follow."""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

from meshrun.diagnose.postmortem import diagnose, format_diagnosis
from meshrun.launch.attempts import AttemptRecorder
from meshrun.launch.failure import (
    LEFT_EARLY_FIX,
    WorkerExit,
    classify_follow_on,
    name_first_to_leave,
)
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


# A rank that left while its peers still ran: exit code 0 is no failure to torch's agent, so only
# the agent's exit records (launch/torch_elastic.py) know it (launch/failure.py name_first_to_leave).
CLOSED = "[pair.cc:553] Connection closed by peer [127.0.0.1]:5018"


def _exit(local_rank, exitcode=0, time=100.0, running=True):
    return WorkerExit(local_rank, local_rank, 1000 + local_rank, exitcode, time, running)


def _classified(*failures):
    return classify_follow_on(list(failures))


def test_a_rank_that_left_before_its_peers_connection_errors_is_named_first():
    peers = _classified(_failure(0, time=100.05, exc="RuntimeError", text=CLOSED),
                        _failure(2, time=100.06, exc="RuntimeError", text=CLOSED))
    exits = {1: _exit(1, time=100.0), 0: _exit(0, 1, 100.1, running=False), 2: _exit(2, 1, 100.1)}
    ordered = name_first_to_leave(peers, exits, host="nodeA")
    assert [f.rank for f in ordered] == [1, 0, 2] and ordered[0].left_early
    assert ordered[0].status == "exit code 0 while the other ranks still ran"
    assert ordered[0].shell_exit_code == 1 and ordered[0].host == "nodeA"
    text = format_summary(ordered, None)
    headline = next(line for line in text.splitlines() if "job failed" in line)
    assert "Rank 1 left first (local rank 1 on nodeA, pid 1001): it exited with code 0 at " in headline
    assert headline.endswith("while ranks 0, 2 still ran") and "Connection" not in headline
    assert f"fix: {LEFT_EARLY_FIX}" in text and "then, as a consequence:" in text


def test_the_same_poll_still_names_the_rank_that_left():
    # the agent saw rank 1 gone and rank 0 failed in one poll (same time): the connection error is the consequence
    peers = _classified(_failure(0, time=100.05, exc="RuntimeError", text=CLOSED))
    ordered = name_first_to_leave(peers, {1: _exit(1, time=100.1), 0: _exit(0, 1, 100.1)})
    assert [f.rank for f in ordered] == [1, 0]


def test_an_exception_of_its_own_stays_the_cause():
    # rank 1 finished and left; rank 0 then raised on its own (say, while saving): not rank 1's doing
    own = _classified(_failure(0, time=101.0, exc="ValueError", text="bad batch"))
    assert [f.rank for f in name_first_to_leave(own, {1: _exit(1, time=100.0), 0: _exit(0, 1, 101.1)})] == [0]


def test_a_timeout_after_a_rank_left_is_a_consequence():
    waited = _classified(_failure(0, time=110.0, exc="RuntimeError",
                                  text="[unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation"))
    assert not waited[0].follow_on  # on its own a timeout is a cause (a mismatched collective)
    ordered = name_first_to_leave(waited, {1: _exit(1, time=100.0), 0: _exit(0, 1, 110.1)})
    assert [f.rank for f in ordered] == [1, 0] and ordered[1].follow_on
    # the hang watchdog's report on a rank stalled in its own code names --hang-timeout: still its own
    stalled = _classified(_failure(0, exitcode=124, time=130.0, exc="HangDetected", text=(
        "hang watchdog: no rank made progress for 20s (--hang-timeout); rank 0 is stalled in user code at t.py:5")))
    assert [f.rank for f in name_first_to_leave(stalled, {1: _exit(1, time=100.0), 0: _exit(0, 124, 130.1)})] == [0]


def test_ranks_that_ended_after_the_failure_or_when_stopped_are_not_named():
    peers = _classified(_failure(0, time=100.0, exc="RuntimeError", text=CLOSED))
    later = {0: _exit(0, 1, 100.1), 1: _exit(1, time=100.2)}  # gone after the failure
    stopped = {0: _exit(0, 1, 100.1), 1: _exit(1, time=100.1, running=False)}  # exited 0 on the agent's SIGTERM
    assert [f.rank for f in name_first_to_leave(peers, later)] == [0]
    assert [f.rank for f in name_first_to_leave(peers, stopped)] == [0]
    assert [f.rank for f in name_first_to_leave(peers, {})] == [0]
    # nothing here failed on its own (on several nodes: the cause is on another): the summary says so
    assert "every failure here followed from another's" in format_summary(peers, None)


def test_a_rank_killed_in_the_same_poll_keeps_the_lead():
    # a SIGKILL (no Python error, not a consequence) seen in the poll that also saw rank 1 gone: it stays first
    killed = _classified(_failure(0, exitcode=-9, time=100.1))
    ordered = name_first_to_leave(killed, {0: _exit(0, -9, 100.1), 1: _exit(1, time=100.1)})
    assert [f.rank for f in ordered] == [0]
    assert [f.rank for f in name_first_to_leave(killed, {0: _exit(0, -9, 100.2), 1: _exit(1, time=100.1)})] == [1, 0]


def test_a_rank_that_ended_without_a_python_error_is_said_to_have():
    ordered = _classified(_failure(1, exitcode=3, time=100.0),
                          _failure(0, time=100.1, exc="RuntimeError", text=CLOSED))
    text = format_summary(ordered, None)
    assert "Rank 1 failed first" in text and "exit code 3" in text
    assert "no Python error was recorded: the process ended at " in text and "followed from it" in text


def test_collect_names_the_rank_that_left_and_reads_its_logs(tmp_path):
    attempt = tmp_path / "run_x" / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
        (attempt / str(rank) / "stdout.log").write_text(f"rank {rank} here\n")
    error_file = attempt / "0" / "error.json"
    error_file.write_text(json.dumps({"message": {"message": f"RuntimeError: {CLOSED}"}, "meshrun": {
        "time": 100.05, "type": "RuntimeError", "text": CLOSED, "file": "t.py", "line": 11,
        "function": "<module>", "rank": "0", "pid": 1000}}))
    pf = SimpleNamespace(local_rank=0, pid=1000, exitcode=1, timestamp=100, error_file=str(error_file))
    exits = {1: _exit(1, time=100.0), 0: _exit(0, 1, 100.1)}
    failures = collect_failures(SimpleNamespace(failures={0: pf}), str(tmp_path), exits=exits)
    assert [f.rank for f in failures] == [1, 0]
    assert failures[0].log_dir == str(attempt / "1") and failures[0].stdout_tail == ["rank 1 here"]
    saved = json.loads((tmp_path / "failures.json").read_text())["failures"]
    assert [(row["rank"], row["exitcode"]) for row in saved] == [(1, 0), (0, 1)]
    # `meshrun diagnose` reads the same record: rank 1 left early, rank 0's error is its consequence
    diag = diagnose(str(tmp_path))
    assert diag.first.rank == 1 and diag.first.kind == "rank left early" and diag.first.fix == LEFT_EARLY_FIX
    assert "rank 0 (consequence)" in format_diagnosis(diag)


def test_attempt_notice_names_the_rank_that_left(tmp_path):
    # --max-restarts: the notice for the failed attempt names rank 1, not a SIGKILL guess
    attempt = tmp_path / "run_x" / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
    (attempt / "0" / "error.json").write_text(json.dumps({"message": {"message": f"RuntimeError: {CLOSED}"},
                                                          "meshrun": {"time": 100.05, "type": "RuntimeError",
                                                                      "text": CLOSED, "rank": "0"}}))
    out = io.StringIO()
    recorder = AttemptRecorder(str(tmp_path), max_restarts=1, stream=out, exits={1: _exit(1, time=100.0)})
    recorder.emit(logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, __file__, 1,
                                    "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                                    (1, 0, 1000, "python"), None))
    line = out.getvalue()
    assert "rank 1 (local rank 1, pid 1001): exit code 0 while the other ranks still ran" in line, line
    assert "SIGKILL" not in line and "restarting" in line
