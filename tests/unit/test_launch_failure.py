"""One failure model: the launcher's summary, its attempt notices and `meshrun diagnose` tell a
rank's failure the same way, from the same RankFailure.

The race these tests pin down: rank 1 raises, and while it is still exiting the agent,
which saw rank 0 fail with a follow-on error, stops it with SIGTERM. The agent then reports rank 1
as exit -15; the rank's error file says it raised. It must be reported as having raised.
"""

from __future__ import annotations

import io
import json
import logging
import signal
from types import SimpleNamespace

import pytest

from meshrun.diagnose.postmortem import diagnose, format_diagnosis
from meshrun.launch.attempts import AttemptRecorder
from meshrun.launch.failure import RankFailure, classify_follow_on, is_follow_on
from meshrun.launch.summary import FAILURES_FILE, collect_failures, format_summary

SIGTERM = -int(signal.SIGTERM)
SITE_LINE = 12


def _rank_dir(root, local_rank: int, exc_type: str, text: str, when: float):
    rank_dir = root / "job_x" / "attempt_0" / str(local_rank)
    rank_dir.mkdir(parents=True)
    (rank_dir / "stdout.log").write_text(f"rank {local_rank} reached step 3\n")
    (rank_dir / "stderr.log").write_text(f"Traceback (most recent call last):\n{exc_type}: {text}\n")
    error = {"message": {"message": f"{exc_type}: {text}"},
             "meshrun": {"time": when, "type": exc_type, "text": text, "file": "/x/fails.py", "line": SITE_LINE,
                         "function": "<module>", "rank": str(local_rank), "pid": 10 + local_rank}}
    (rank_dir / "error.json").write_text(json.dumps(error))
    return rank_dir


@pytest.fixture
def race(tmp_path):
    """The launch log tree of the race: rank 1 raised first; rank 0 followed; the agent SIGTERMed rank 1."""
    d1 = _rank_dir(tmp_path, 1, "ValueError", "bad batch at step 3", 100.0)
    d0 = _rank_dir(tmp_path, 0, "RuntimeError", "[pair.cc:534] Connection closed by peer [127.0.0.1]:5", 100.2)
    # What torchelastic's ChildFailedError holds: whole-second timestamps, rank 1 as exit -15.
    error = SimpleNamespace(failures={
        0: SimpleNamespace(local_rank=0, pid=10, exitcode=1, timestamp=100, error_file=str(d0 / "error.json")),
        1: SimpleNamespace(local_rank=1, pid=11, exitcode=SIGTERM, timestamp=100, error_file=str(d1 / "error.json")),
    })
    return tmp_path, error


def test_a_rank_that_raised_then_was_sigtermed_is_reported_as_having_raised():
    f = RankFailure(1, 1, pid=11, exitcode=SIGTERM, time=100.0, exc_type="ValueError", exc_text="bad batch")
    assert f.raised and not is_follow_on(f)
    assert f.status == "raised ValueError, then stopped by SIGTERM from the agent while exiting"
    assert f.shell_exit_code == 1  # what the rank itself exited with, not 128 + SIGTERM
    assert f.describe() == ("rank 1 (local rank 1, pid 11): ValueError: bad batch, "
                            "then stopped by SIGTERM from the agent while exiting")
    # Without an exception, SIGTERM is the agent stopping a survivor: a consequence.
    stopped = RankFailure(0, 0, pid=10, exitcode=SIGTERM)
    assert not stopped.raised and is_follow_on(stopped) and stopped.status == "killed by SIGTERM"
    assert stopped.shell_exit_code == 128 + int(signal.SIGTERM)


@pytest.mark.parametrize(("exitcode", "status"), [
    (1, "raised ValueError, exit code 1"),
    (SIGTERM, "raised ValueError, then stopped by SIGTERM from the agent while exiting"),
    (-int(signal.SIGABRT), "raised ValueError, then killed by SIGABRT"),
    (None, "raised ValueError"),
])
def test_status_of_a_rank_that_raised(exitcode, status):
    f = RankFailure(1, 1, exitcode=exitcode, exc_type="ValueError", exc_text="x")
    assert f.status == status and "raised ValueError" in f.status


def test_ordering_is_the_same_whatever_the_agent_reported():
    cause = RankFailure(1, 1, exitcode=SIGTERM, time=100.0, exc_type="ValueError", exc_text="bad batch")
    peer = RankFailure(0, 0, exitcode=1, time=99.0, exc_type="RuntimeError", exc_text="Connection closed by peer")
    assert [f.rank for f in classify_follow_on([peer, cause])] == [1, 0]


def test_launcher_summary_of_the_race(race):
    root, error = race
    failures = collect_failures(error, str(root))
    assert [f.rank for f in failures] == [1, 0] and failures[0].shell_exit_code == 1
    text = format_summary(failures, str(root))
    headline = next(line for line in text.splitlines() if "failed first" in line)
    assert "Rank 1 failed first" in headline and "raised ValueError" in headline, text
    assert "killed by" not in headline
    assert f"at /x/fails.py:{SITE_LINE} in <module>" in text and "rank 1 reached step 3" in text
    assert "then, as a consequence:" in text and "rank 0: RuntimeError: [pair.cc:534] Connection closed" in text
    saved = json.loads((root / FAILURES_FILE).read_text())["failures"]
    assert [(row["rank"], row["signal"], row["exc_type"]) for row in saved] == [
        (1, "SIGTERM", "ValueError"), (0, None, "RuntimeError")]


def test_attempt_notice_of_the_race(race):
    root, _ = race
    out = io.StringIO()
    recorder = AttemptRecorder(str(root), max_restarts=1, stream=out)
    record = logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, __file__, 1,
                               "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                               (SIGTERM, 1, 11, "python"), None)
    recorder.emit(record)
    line = out.getvalue()
    assert f"rank 1 (local rank 1, pid 11): ValueError: bad batch at step 3 at /x/fails.py:{SITE_LINE}" in line
    assert "killed by" not in line and "consequence" not in line


def test_attempt_notice_when_the_agent_picked_the_follow_on_rank(race):
    # The agent's whole-second ordering can name rank 0 (the 'Connection closed' consequence) as its
    # first failure; the notice still leads with rank 1, and its pid comes from its error file.
    root, _ = race
    out = io.StringIO()
    recorder = AttemptRecorder(str(root), max_restarts=1, stream=out)
    record = logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, __file__, 1,
                               "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                               (1, 0, 10, "python"), None)
    recorder.emit(record)
    line = out.getvalue()
    assert f"rank 1 (local rank 1, pid 11): ValueError: bad batch at step 3 at /x/fails.py:{SITE_LINE}" in line
    assert "consequence" not in line


def test_diagnose_of_the_race(race):
    root, error = race
    collect_failures(error, str(root))  # writes failures.json, as the launcher does
    diag = diagnose(str(root))
    text = format_diagnosis(diag)
    assert diag.first.rank == 1 and diag.first.kind == "exception in user code", text
    assert diag.first.status.startswith("raised ValueError")
    assert "first failure: rank 1" in text and "ValueError: bad batch at step 3" in text
    assert "rank 0 (consequence)" in text
    data = diag.to_json()
    assert data["first_failure"]["signal"] == "SIGTERM" and data["first_failure"]["exc_type"] == "ValueError"
    assert [row["rank"] for row in data["timeline"]] == [1, 0]


def test_error_file_formats_read_alike(tmp_path):
    f = RankFailure(-1, 2)
    f.read_error_data({"meshrun": {"time": 5.0, "type": "KeyError", "text": "'x'", "file": "a.py", "line": 3,
                                   "function": "f", "rank": "6", "hint": "h"}})
    assert (f.rank, f.time, f.exception, f.site, f.hint) == (6, 5.0, "KeyError: 'x'", "a.py:3 in f", "h")
    g = RankFailure(3, 3)
    g.read_error_data({"message": {"message": "KeyError: 'x'",
                                   "extraInfo": {"py_callstack": 'File "a.py", line 3, in f\n'}}})
    assert (g.exception, g.site) == ("KeyError: 'x'", "a.py:3 in f")
    h = RankFailure(0, 0)
    h.read_exception_from_log(["Traceback (most recent call last):", '  File "b.py", line 9, in g',
                               "meshrun.debug.watchdog.HangDetected: stalled"])
    assert (h.exc_type, h.site) == ("meshrun.debug.watchdog.HangDetected", "b.py:9 in g")
