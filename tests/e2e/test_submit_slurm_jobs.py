"""`meshrun submit --scheduler slurm` on a real one-node SLURM (slurm_cluster.py; skipped only when SLURM cannot run).

- tiny on 1 node x 2 processes runs to completion under sbatch;
- a job sent SIGUSR1 mid-run (to the batch shell, as `--signal=B:USR1@N` does before the time
  limit) commits a checkpoint, is requeued once, and finishes with final weights bitwise equal to
  the uninterrupted job's; `pytest -s` prints the time from the signal to the first step after
  the requeue (SLURM holds a requeued job for its credential's lifetime + 1 s before it may start
  again: 121 s by default, 6 s in this cluster, cred_expire=5 in slurm_cluster.py);
- what SLURM refuses (a partition it does not have) and a script meshrun did not write: one line,
  exit 2, nothing submitted.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, TINY, child_env
from slurm_cluster import slurm_cluster

STEPS = 200
SIGNAL_AT = 30  # the step after which the second job gets SIGUSR1
SETTINGS = ["--set", f"train.steps={STEPS}", "--set", "metrics.interval=1"]
JOB_DEADLINE_S = 90


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def _submit(cluster, runs: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "meshrun"), "submit", TINY, "--scheduler", "slurm", "--nproc-per-node", "2",
           "--set", f"train.name={name}", "--set", f"train.run_dir={runs}", *SETTINGS, *extra]
    done = subprocess.run(cmd, env=child_env({"SLURM_CONF": cluster.env["SLURM_CONF"]}), capture_output=True, text=True, timeout=60, check=False)
    if done.returncode == 0:
        cluster.jobs.append(done.stdout.split()[0])
    return done


def _wait(cluster, job_id: str, run_dir: Path) -> None:
    """Until the run's finished marker is written and the job has left the queue."""
    deadline = time.monotonic() + JOB_DEADLINE_S
    while time.monotonic() < deadline:
        state = cluster.state(job_id)
        if not state and (run_dir / "finished.json").is_file():
            return
        time.sleep(0.2)
    out = "\n".join(p.read_text()[-3000:] for p in (run_dir / "logs").glob("slurm-*.out"))
    pytest.fail(f"job {job_id} not finished within {JOB_DEADLINE_S} s (state {cluster.state(job_id)!r})\n{out}\n"
                f"{cluster.logs()}")


def _rows(run_dir: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


@pytest.fixture(scope="module")
def uninterrupted(cluster, runs) -> tuple[str, Path]:
    done = _submit(cluster, runs, "plain")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.split()[0]
    _wait(cluster, job_id, runs / "plain")
    return job_id, runs / "plain"


@pytest.mark.timeout(150)
def test_tiny_runs_to_completion(cluster, uninterrupted):
    job_id, run_dir = uninterrupted
    assert json.loads((run_dir / "finished.json").read_text())["step"] == STEPS
    assert (run_dir / "slurm" / "job_id").read_text().strip() == job_id
    out = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "[rank 1]" in out or "rank 1" in out or "2 x cpu" in out, out[-2000:]
    assert "requeue" not in out.lower().replace("--requeue", "")
    status = subprocess.run([str(BIN / "meshrun"), "submit", "--status", str(run_dir)], env=child_env({"SLURM_CONF": cluster.env["SLURM_CONF"]}),
                            capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 0 and f"job {job_id}: not in the queue" in status.stdout, status


@pytest.mark.timeout(200)
def test_usr1_checkpoints_requeues_and_resumes_exactly(cluster, runs, uninterrupted):
    done = _submit(cluster, runs, "usr1")
    assert done.returncode == 0, done.stderr
    job_id, run_dir = done.stdout.split()[0], runs / "usr1"
    deadline = time.monotonic() + JOB_DEADLINE_S
    while not any(r.get("kind") == "train" and r["step"] >= SIGNAL_AT for r in _rows(run_dir)):
        assert time.monotonic() < deadline and cluster.state(job_id), f"job {job_id} never reached step {SIGNAL_AT}"
        time.sleep(0.05)
    signalled = time.time()
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)  # what --signal=B:USR1@N sends before --time
    _wait(cluster, job_id, run_dir)

    out = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert out.count("requeueing job") == 1 and cluster.restarts(job_id) == 1, out[-3000:]
    marker = json.loads((run_dir / "checkpoints" / "preempted.json").read_text())
    assert marker["signal"] == "SIGTERM" and SIGNAL_AT <= marker["step"] < STEPS, marker
    rows = _rows(run_dir)
    starts = [i for i, r in enumerate(rows) if r.get("kind") == "meta" and "start_step" in r]
    assert len(starts) == 2 and rows[starts[1]]["start_step"] == marker["step"], [rows[i] for i in starts]
    first_after = next(r for r in rows[starts[1]:] if r.get("kind") == "train")
    print(f"\nSIGUSR1 at step >= {SIGNAL_AT}: checkpoint of step {marker['step']}, requeued; first step after the "
          f"requeue (step {first_after['step']}) {first_after['time'] - signalled:.1f} s after the signal "
          "(SLURM's requeue hold: cred_expire=5 s)")

    expected = torch.load(uninterrupted[1] / "model.pt", weights_only=True)
    got = torch.load(run_dir / "model.pt", weights_only=True)
    assert expected.keys() == got.keys()
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not differ, f"weights differ from the uninterrupted job's: {differ[:5]}"


@pytest.mark.timeout(60)
def test_partition_slurm_refuses_is_one_line(cluster, runs):
    done = _submit(cluster, runs, "badpart", "--partition", "nosuchpartition")
    assert done.returncode == 2, done
    assert len(done.stderr.strip().splitlines()) == 1 and "partition" in done.stderr, done.stderr
    assert not (runs / "badpart" / "slurm" / "job_id").exists()
    assert cluster.run("squeue", "-h", "-n", "badpart").stdout.strip() == ""


@pytest.mark.timeout(60)
def test_a_script_meshrun_did_not_write_is_kept(cluster, runs):
    script = runs / "mine.sbatch"
    script.write_text("#!/bin/bash\necho my own script\n")
    done = _submit(cluster, runs, "kept", "--script", str(script))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done
    assert script.read_text() == "#!/bin/bash\necho my own script\n"
    assert cluster.run("squeue", "-h", "-n", "kept").stdout.strip() == ""
