"""A `SubmitJob` as an sbatch script, and the sbatch/squeue/scancel calls `meshrun submit` makes.

    meshrun submit examples/configs/tiny.toml --scheduler slurm --nodes 2 --nproc-per-node 4 --dry-run

The script runs one `srun` task per node (`--ntasks-per-node=1`), each `meshrun train` with a
c10d rendezvous on the job's first node. Before the time limit SLURM sends SIGUSR1 to the batch
shell alone (`--signal=B:USR1@N`). Without `B:` SLURM would signal every process of every step:
no one would know to requeue, and SIGUSR1's default action ends the helpers (multiprocessing's
resource tracker, ...) that are not meshrun's to change. The shell's trap notes the signal and
sends SIGTERM to the job's steps (`scancel --signal=TERM`, the batch shell excluded): every
process of meshrun train already takes SIGTERM as "commit a checkpoint at the next step, then
exit 0" (checkpoint/preemption.py), the same path as a SLURM preemption. When srun has returned,
the shell requeues the job once (`scontrol requeue`) unless the run finished; the requeued job runs
the same script under the same job id and resumes from the newest checkpoint. docs/cluster.md
shows the whole flow.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

from meshrun.cluster.job import SubmitJob
from meshrun.errors import ConfigError, LaunchError
from meshrun.launch.slurm import SLURM_PORT_BASE, SLURM_PORT_SPAN
from meshrun.rundir.runs import FINISHED_FILE

MARKER = "# written by meshrun submit"  # the script's second line: a file without it is the user's
SCRIPT_DIR = "slurm"  # RUN/slurm/: the script and the job ids (the run's own files stay as train leaves them)
SCRIPT_NAME = "job.sbatch"
JOB_ID_FILE = "job_id"  # the last submitted job's id, for `meshrun submit --status/--cancel RUN`
SIGNAL_LEAD_S = 90  # default seconds before the time limit that SIGUSR1 comes
COMMAND_TIMEOUT_S = 60  # any one sbatch/squeue/scancel call
_JOB_ID = re.compile(r"^\d+(_\d+)?$")


def script_path(job: SubmitJob) -> Path:
    return job.run_dir / SCRIPT_DIR / SCRIPT_NAME


def is_ours(path: Path) -> bool:
    """A script this module wrote (its marker line), which a new submit may replace."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            return MARKER in fp.read(4096).splitlines()[:3]
    except OSError:
        return False


def render(job: SubmitJob, *, python: str, signal_lead_s: int = SIGNAL_LEAD_S) -> str:
    """The sbatch script: #SBATCH lines, the rendezvous host, srun, the USR1 trap and the one requeue."""
    if signal_lead_s < 1:
        raise ConfigError(f"--signal-lead {signal_lead_s}: must be at least 1 (seconds before --time)")
    logs = job.run_dir / "logs"
    sbatch = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
              f"--cpus-per-task={job.nproc_per_node}", "--requeue", "--open-mode=append",
              f"--output={logs}/slurm-%j.out", f"--signal=B:USR1@{signal_lead_s}"]
    if job.gpus_per_node:
        sbatch.append(f"--gpus-per-node={job.gpus_per_node}")
    for flag, value in (("--time", job.time_limit), ("--partition", job.partition), ("--account", job.account)):
        if value:
            sbatch.append(f"{flag}={value}")
    sbatch += list(job.extra)
    train = [python, "-m", "meshrun", "train", *job.train_args(), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "$MESHRUN_RDZV_HOST:$MESHRUN_RDZV_PORT", "--rdzv-id", "$SLURM_JOB_ID"]
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(job.env.items()))
    return f"""#!/bin/bash
{MARKER} (meshrun/cluster/slurm.py; docs/cluster.md): edit freely, then sbatch it yourself
{"".join(f"#SBATCH {line}{chr(10)}" for line in sbatch)}
set -u
mkdir -p {shlex.quote(str(logs))}
{exports}# c10d rendezvous on the job's first node, the same host and port on every node
export MESHRUN_RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# the port: launch/slurm.py's rule (one per job id, so two jobs that share a first node do not meet)
export MESHRUN_RDZV_PORT=${{MESHRUN_RDZV_PORT:-$(( {SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN} ))}}
echo "meshrun submit: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST, \\
rendezvous $MESHRUN_RDZV_HOST:$MESHRUN_RDZV_PORT, $(date -u +%FT%TZ)"

# SIGUSR1 before the time limit (--signal=B:USR1@N, to this shell only): note it, and send SIGTERM
# to the job's steps (not this shell): meshrun train commits a checkpoint and exits 0.
requeue=0
trap 'requeue=1; echo "meshrun submit: SIGUSR1 at $(date -u +%FT%TZ): checkpoint, then requeue"; \\
scancel --signal=TERM "$SLURM_JOB_ID"' USR1
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\
  {_shell_join(train)} &
srun_pid=$!
while :; do
  wait "$srun_pid"; status=$?
  kill -0 "$srun_pid" 2>/dev/null || break  # still running: wait returned for the trap
done
if [ "$requeue" = 1 ] && [ ! -f {shlex.quote(str(job.run_dir / FINISHED_FILE))} ]; then
  echo "meshrun submit: srun exited $status; requeueing job $SLURM_JOB_ID once"
  scontrol requeue "$SLURM_JOB_ID" && exit 0
fi
exit "$status"
"""


def _shell_join(words: list[str]) -> str:
    """Quoted for the shell, except the $VARIABLES the script sets (double-quoted so they expand)."""
    return " ".join(f'"{w}"' if w.startswith("$") else shlex.quote(w) for w in words)


def require(*commands: str) -> None:
    """Each SLURM command on PATH, or one line naming it (before anything is written or submitted)."""
    for command in commands:
        if shutil.which(command) is None:
            raise ConfigError(f"--scheduler slurm: {command!r} is not on PATH; run meshrun submit on a SLURM "
                              "login node (or put SLURM's bin directory on PATH), or use --dry-run to print the script")


def _run(argv: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{what}: `{shlex.join(argv[:2])} ...` did not answer within {COMMAND_TIMEOUT_S} s; "
                          "is slurmctld up (`scontrol ping`)?") from None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower()), lines[0] if lines else "no message")


def check_with_sbatch(path: Path) -> None:
    """`sbatch --test-only`: SLURM checks the partition, account, limits and resources, submits nothing."""
    done = _run(["sbatch", "--test-only", str(path)], "sbatch --test-only")
    if done.returncode != 0:
        raise ConfigError(f"SLURM refuses the job ({_first_line(done.stderr + done.stdout)}); "
                          f"check --partition/--account/--time/--nodes (`sinfo` lists partitions), script {path}")


def submit(path: Path) -> str:
    """`sbatch --parsable SCRIPT` -> the job id (recorded next to the script)."""
    done = _run(["sbatch", "--parsable", str(path)], "sbatch")
    job_id = done.stdout.strip().split(";")[0]
    if done.returncode != 0 or not _JOB_ID.match(job_id):
        raise LaunchError(f"sbatch failed ({_first_line(done.stderr + done.stdout)}); script {path}")
    (path.parent / JOB_ID_FILE).write_text(job_id + "\n")
    return job_id


def recorded_job_id(run_dir: Path) -> str:
    """The id `submit` recorded for the run directory `run_dir`, or one line saying there is none."""
    try:
        job_id = (run_dir / SCRIPT_DIR / JOB_ID_FILE).read_text()[:64].strip()
    except OSError:
        job_id = ""
    if not _JOB_ID.match(job_id):
        raise ConfigError(f"{run_dir}: no job id recorded in {run_dir / SCRIPT_DIR / JOB_ID_FILE}; give "
                          "the job id (meshrun submit --status JOBID) or the run directory of a submitted job")
    return job_id


def status(job_id: str) -> str:
    """squeue's line for the job, or that it has left the queue."""
    done = _run(["squeue", "-h", "-j", job_id, "-o", "%i %j %T %M %l %D %R"], "squeue")
    line = done.stdout.strip()
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        raise LaunchError(f"squeue -j {job_id} failed ({_first_line(done.stderr)})")
    return f"job {line}" if line else f"job {job_id}: not in the queue (finished, cancelled or unknown)"


def cancel(job_id: str) -> str:
    done = _run(["scancel", job_id], "scancel")
    if done.returncode != 0:
        raise LaunchError(f"scancel {job_id} failed ({_first_line(done.stderr)})")
    return f"job {job_id}: cancelled (scancel)"
