"""What `meshrun submit` hands to every scheduler: one job, checked once (cli/submit.py builds it).

Each scheduler module turns a `SubmitJob` into its own text (an sbatch script, Kubernetes
manifests) and never re-reads the command line: a rule about the job lives here, once."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.errors import ConfigError

RDZV_PORT = 29500  # the c10d rendezvous port on the first node (torchrun's default)
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")  # SLURM's time formats: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a DNS-1123 label: what Kubernetes takes as a name


@dataclass(frozen=True)
class SubmitJob:
    """One `meshrun train` job for a cluster: `nodes` x `nproc_per_node` workers."""

    config: Path  # the job's config file, as the nodes will read it (a shared filesystem or the image)
    name: str  # the job's name: train.name, the scheduler's job name
    run_root: Path  # train.run_dir: the run directory is run_root/name (shared by every node)
    nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0  # 0: CPU workers (gloo)
    overrides: tuple[str, ...] = ()  # the user's --set KEY=VALUE, passed on to `meshrun train`
    max_restarts: int = 0  # torchrun's --max-restarts on every node
    time_limit: str | None = None  # the scheduler's wall-clock limit (SLURM's --time format)
    partition: str | None = None  # SLURM
    account: str | None = None  # SLURM
    extra: tuple[str, ...] = ()  # the scheduler's own lines, passed through (e.g. "--mem=8G" for #SBATCH)
    image: str | None = None  # Kubernetes: the container image holding meshrun and the config
    volume: str | None = None  # Kubernetes: the PersistentVolumeClaim mounted at run_root on every node
    namespace: str | None = None  # Kubernetes: the namespace (kubectl's current one if None)
    address: str | None = None  # Ray: the cluster (ray://HOST:10001, HOST:6379, auto); None = RAY_ADDRESS or a local Ray
    env: dict[str, str] = field(default_factory=dict)  # set on every node

    def __post_init__(self):
        for key, value in (("--nodes", self.nodes), ("--nproc-per-node", self.nproc_per_node)):
            if value < 1:
                raise ConfigError(f"{key} {value}: must be at least 1")
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node {self.gpus_per_node}: must be 0 (CPU) or more")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node}: more processes than --gpus-per-node "
                              f"{self.gpus_per_node}; give one process per GPU")
        if self.gpus_per_node > self.nproc_per_node:  # a worker drives one device: the rest would sit idle
            raise ConfigError(f"--gpus-per-node {self.gpus_per_node}: more GPUs than --nproc-per-node "
                              f"{self.nproc_per_node} can use (one process per GPU); give --nproc-per-node "
                              f"{self.gpus_per_node}, or --gpus-per-node {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be 0 or more")
        if self.time_limit is not None and not _TIME.match(self.time_limit):
            raise ConfigError(f"--time {self.time_limit!r}: not a time limit; use HH:MM:SS, MM or D-HH:MM:SS")
        if not DNS_LABEL.match(self.name) or len(self.name) > 63:
            raise ConfigError(f"train.name {self.name!r}: a cluster job's name must be lowercase letters, digits "
                              f"and '-', at most 63, starting and ending with a letter or digit")

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def run_dir(self) -> Path:
        return self.run_root / self.name

    def train_args(self) -> list[str]:
        """`meshrun train`'s arguments on every node, without the rendezvous (each scheduler adds its own)."""
        args = [str(self.config), "--set", f"train.name={self.name}", "--set", f"train.run_dir={self.run_root}"]
        for override in self.overrides:
            args += ["--set", override]
        return [*args, "--nnodes", str(self.nodes), "--nproc-per-node", str(self.nproc_per_node),
                "--max-restarts", str(self.max_restarts)]

    def train_command(self) -> str:
        """`train_args` as one shell-quoted line (after `meshrun train`)."""
        return shlex.join(self.train_args())
