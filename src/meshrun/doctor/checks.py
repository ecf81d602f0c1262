"""The install and machine checks behind `meshrun doctor`: each one a small function -> Check.

Every function takes its inputs as arguments (with the live machine as the default), so unit
tests can feed fake hostnames, statvfs results and versions. Environment-variable checks live
in `meshrun.doctor.env_checks`, the live all_reduce test in `meshrun.doctor.smoke`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from meshrun.runtime.device import usable_cpus

PASS, WARN, FAIL, INFO = "PASS", "WARN", "FAIL", "INFO"
STATUSES = (PASS, WARN, FAIL, INFO)

# DataLoader workers pass batches through /dev/shm and NCCL keeps its intra-node buffers there;
# docker's default of 64 MiB is the usual "Bus error" / "unable to write to file </torch_...>".
MIN_SHM_BYTES = 1 << 30
SHM_FIX = (
    "DataLoader workers and NCCL need shared memory: in docker pass --shm-size=8g (or --ipc=host); "
    "on Kubernetes mount an emptyDir with medium: Memory at /dev/shm"
)


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report. `fix` is one line, required for anything but PASS."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status
        # The report promises one line per field; flatten anything multi-line a check produced.
        object.__setattr__(self, "detail", " ".join(self.detail.split()))
        object.__setattr__(self, "fix", " ".join(self.fix.split()))

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def format_bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024:
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} TiB"


# --- the guide's install check -----------------------------------------------------------


def torch_build(torch_mod: Any = None) -> str:
    """'CUDA 12.6', 'ROCm 6.2' or 'CPU-only', from torch.version."""
    if torch_mod is None:
        import torch as torch_mod
    if getattr(torch_mod.version, "cuda", None):
        return f"CUDA {torch_mod.version.cuda}"
    if getattr(torch_mod.version, "hip", None):
        return f"ROCm {torch_mod.version.hip}"
    if getattr(torch_mod.version, "xpu", None):
        return f"XPU {torch_mod.version.xpu}"
    return "CPU-only"


def check_torch(torch_mod: Any = None) -> Check:
    if torch_mod is None:
        import torch as torch_mod
    build = torch_build(torch_mod)
    return Check("torch", PASS, f"{torch_mod.__version__}, {build} build")


def check_devices(torch_mod: Any = None) -> Check:
    """Accelerators torch can see: what `--nproc-per-node auto` will use."""
    if torch_mod is None:
        import torch as torch_mod
    accelerator = torch_mod.accelerator.current_accelerator()
    count = torch_mod.accelerator.device_count() if accelerator is not None else 0
    build = torch_build(torch_mod)
    if accelerator is not None and count > 0:
        return Check("devices", PASS, f"{count} x {accelerator.type}: one process per device")
    cpus = usable_cpus()
    if build == "CPU-only":
        return Check(
            "devices",
            INFO,
            f"no accelerator; {cpus} CPU cores: training runs as CPU processes over gloo",
            "expected on a CPU machine; for GPUs install a CUDA build of torch "
            "(pip install torch --index-url https://download.pytorch.org/whl/cu126)",
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return Check(
        "devices",
        WARN,
        f"{build} build but no GPU visible{hint}; training would fall back to CPU",
        "run nvidia-smi to check the driver, and unset or fix CUDA_VISIBLE_DEVICES",
    )


def check_distributed(dist_mod: Any = None) -> Check:
    if dist_mod is None:
        import torch.distributed as dist_mod
    if dist_mod.is_available():
        return Check("distributed", PASS, "torch.distributed.is_available() is True")
    return Check(
        "distributed",
        FAIL,
        "torch.distributed.is_available() is False: this torch was built without it",
        "install an official torch wheel (pip install torch); builds with USE_DISTRIBUTED=0 cannot train on >1 process",
    )


def check_backends(dist_mod: Any = None, *, num_gpus: int | None = None) -> list[Check]:
    """gloo (CPU), NCCL (CUDA GPUs), MPI (optional). No NCCL on a CPU machine is only INFO."""
    if dist_mod is None:
        import torch.distributed as dist_mod
    if num_gpus is None:
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not dist_mod.is_available():
        return []
    checks = []
    if dist_mod.is_gloo_available():
        checks.append(Check("gloo", PASS, "available: the CPU backend"))
    else:
        checks.append(
            Check("gloo", FAIL, "not available: CPU processes have no backend",
                  "install an official torch wheel, which bundles gloo")
        )
    if dist_mod.is_nccl_available():
        checks.append(Check("nccl", PASS, "available: the CUDA GPU backend"))
    elif num_gpus == 0:
        checks.append(
            Check("nccl", INFO, "not available (no CUDA in this build or no GPU); CPU training uses gloo",
                  "nothing to do on a CPU machine; NCCL ships with the CUDA builds of torch")
        )
    else:
        checks.append(
            Check("nccl", WARN, f"not available, but {num_gpus} GPU(s) are visible: GPU training would use slow gloo",
                  "install a CUDA build of torch on Linux (its wheels bundle NCCL)")
        )
    if dist_mod.is_mpi_available():
        checks.append(Check("mpi", PASS, "available"))
    else:
        checks.append(
            Check("mpi", INFO, "not available (official wheels are built without MPI)",
                  "only needed for backend='mpi'; gloo and NCCL cover CPU and GPU training")
        )
    return checks


# --- what breaks launches ----------------------------------------------------------------


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def check_hostname(
    hostname: str | None = None, resolve: Callable[[str], str] = socket.gethostbyname
) -> Check:
    """The hostname must resolve; resolving to 127.x works on one node but breaks multi-node."""
    hostname = socket.gethostname() if hostname is None else hostname
    try:
        address = resolve(hostname)
    except OSError as exc:
        return Check(
            "hostname",
            FAIL,
            f"{hostname!r} does not resolve ({exc})",
            f"add '<this host's IP> {hostname}' to /etc/hosts (or fix DNS); torchrun's rendezvous resolves it",
        )
    if _is_loopback(address):
        return Check(
            "hostname",
            WARN,
            f"{hostname!r} resolves to loopback {address}: fine on one node, a trap for multi-node",
            f"for multi-node map {hostname} to its network address in /etc/hosts or DNS, "
            "or set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to the interface peers reach",
        )
    return Check("hostname", PASS, f"{hostname!r} resolves to {address}")


def check_loopback(host: str = "127.0.0.1") -> Check:
    """Bind a free loopback port, listen and connect to it: what every single-node job does."""
    try:
        localhost = socket.gethostbyname("localhost")
    except OSError as exc:
        return Check("loopback", FAIL, f"'localhost' does not resolve ({exc})",
                     "add '127.0.0.1 localhost' to /etc/hosts")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind((host, 0))
            server.listen(1)
            server.settimeout(5)
            port = server.getsockname()[1]
            with socket.create_connection((host, port), timeout=5):
                conn, _ = server.accept()
                conn.close()
    except OSError as exc:
        return Check("loopback", FAIL, f"cannot bind and connect on {host}: {exc}",
                     "bring up the loopback interface (ip link set lo up) and allow local TCP in the firewall")
    if not _is_loopback(localhost):
        return Check("loopback", WARN, f"'localhost' resolves to {localhost}, not a loopback address",
                     "map localhost to 127.0.0.1 in /etc/hosts; single-node rendezvous uses localhost")
    return Check("loopback", PASS, f"bound and connected to {host}:{port}; localhost is {localhost}")


def shm_usage(path: str = "/dev/shm", statvfs: Callable[[str], Any] = os.statvfs) -> tuple[int, int] | None:
    """(total, free) bytes of the shared-memory filesystem, or None when there is none."""
    try:
        st = statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def check_shm(usage: tuple[int, int] | None, *, path: str = "/dev/shm", minimum: int = MIN_SHM_BYTES) -> Check:
    if usage is None:
        return Check("shm", INFO, f"{path} not found (not Linux?)",
                     "nothing to do off Linux; on Linux /dev/shm should be a tmpfs of a few GiB")
    total, free = usage
    detail = f"{path}: {format_bytes(total)} total, {format_bytes(free)} free"
    if total < minimum:
        return Check("shm", WARN, f"{detail}; under {format_bytes(minimum)} (docker's default is 64 MiB)", SHM_FIX)
    if free < minimum:
        return Check("shm", WARN, f"{detail}; under {format_bytes(minimum)} free",
                     f"remove stale files in {path} (old torch_* or nccl-* segments) or enlarge it; {SHM_FIX}")
    return Check("shm", PASS, detail)
