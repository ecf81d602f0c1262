"""A real one-node SLURM for tests: slurmctld and slurmd in the foreground, under a temporary directory.

    with slurm_cluster(tmp_path) as cluster:     # pytest.skip(reason) when SLURM cannot start here
        subprocess.run(["sbatch", ...], env=cluster.env)

Debian's `slurm-wlm` (22.05; `.ci/run` installs it) is used as installed. The config is minimal:
this machine as the one node with its CPUs (jobs may share them: OverSubscribe=FORCE), no
accounting, proctrack/linuxproc and task/none (no cgroups needed), and auth/none + cred/none, so
no munged is needed (the plugins ship in slurm-wlm-basic-plugins). A requeued job waits
`cred_expire` + 1 s before it may start again (its old credential must expire first; SLURM's
default is 120 s): 5 s here, and the scheduler looks every second instead of every 60. Both daemons run as children
of this process, each under `timeout` (so neither outlives a killed test run), on free ports, and
are stopped by pid; the jobs submitted through `cluster.sbatch` are cancelled first.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DAEMON_LIMIT_S = 600  # `timeout` around each daemon: the longest a test module may hold them
START_DEADLINE_S = 30
COMMANDS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
PLUGIN_GLOBS = ("/usr/lib/*/slurm-wlm/auth_none.so", "/usr/lib*/slurm/auth_none.so", "/usr/local/lib/slurm/auth_none.so")


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"{argv} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def state(self, job_id: str) -> str:
        """squeue's state of the job ('' once it has left the queue)."""
        return self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False).stdout.strip()

    def restarts(self, job_id: str) -> int:
        text = self.run("scontrol", "show", "job", job_id, check=False).stdout
        for word in text.split():
            if word.startswith("Restarts="):
                return int(word.split("=", 1)[1])
        return 0

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n" + p.read_text(errors="replace")[-3000:]
                         for p in sorted(self.root.glob("*.log")) if p.is_file())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(root: Path, host: str, cpus: int) -> str:
    return f"""ClusterName=meshrun-test
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
AuthInfo=cred_expire=5
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=2
InactiveLimit=0
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def why_not() -> str | None:
    """Why SLURM cannot run here, or None."""
    if os.geteuid() != 0:
        return "the test SLURM runs its daemons as root (SlurmdUser=root); not root here"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} not on PATH); apt-get install -y slurm-wlm (.ci/run does)"
    if not any(glob.glob(pattern) for pattern in PLUGIN_GLOBS):
        return "SLURM's auth/none plugin is not installed (slurm-wlm-basic-plugins); this fixture does not run munged"
    return None


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """Start slurmctld + slurmd under `root`; skip the test with the reason when they cannot start."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (root / sub).mkdir(exist_ok=True)
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(_config(root, host, os.cpu_count() or 1))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SQUEUE_")) and k != "SLURM_CONF"]:
        del env[name]  # a test run inside a SLURM job: these would be read by sbatch and srun
    cluster = SlurmCluster(root=root, env=env)
    try:
        for daemon in ("slurmctld", "slurmd"):
            out = open(root / f"{daemon}.out", "w")  # noqa: SIM115 - closed with the process
            cluster.daemons.append(subprocess.Popen(
                ["timeout", "-k", "5", str(DAEMON_LIMIT_S), daemon, "-D", "-f", str(conf)],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            out.close()
        _wait_idle(cluster, host)
        yield cluster
    finally:
        _stop(cluster)


def _wait_idle(cluster: SlurmCluster, host: str) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        dead = [p for p in cluster.daemons if p.poll() is not None]
        if dead:
            break
        done = cluster.run("sinfo", "-h", "-n", host, "-o", "%t", check=False, timeout=10)
        if done.returncode == 0 and done.stdout.strip() in ("idle", "mix", "alloc"):
            return
        time.sleep(0.3)
    pytest.skip(f"SLURM did not start within {START_DEADLINE_S} s here:\n{cluster.logs()}")


def _stop(cluster: SlurmCluster) -> None:
    """Cancel this cluster's jobs (their processes are slurmstepd's, not ours), then stop the daemons by pid."""
    for job_id in cluster.jobs:
        with contextlib.suppress(Exception):
            cluster.run("scancel", job_id, check=False, timeout=10)
    deadline = time.monotonic() + 15
    while cluster.jobs and time.monotonic() < deadline and any(cluster.state(j) for j in cluster.jobs):
        time.sleep(0.3)
    for proc in reversed(cluster.daemons):  # slurmd first, then slurmctld
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)  # `timeout` passes it on to its daemon
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own group (start_new_session): `timeout` and the daemon
            proc.wait(timeout=10)
