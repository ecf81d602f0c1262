"""What the hardware did: peak memory, accelerator peak FLOPs and MFU, and per-step timing."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Dense (no 2:4 sparsity) peak FLOP/s of one device, in TFLOP/s: (bf16, fp16, tf32, fp32).
# fp32 is the non-tensor-core rate; tf32 applies when fp32 matmuls may use TF32 tensor cores
# (torch.set_float32_matmul_precision("high")). None = the dtype has no native support.
# Sources: NVIDIA datasheets (spec sheets print the sparse rate; these are half of it), the
# Ampere GA102 / Ada whitepapers for GeForce cards (fp32 accumulate), AMD's MI300X datasheet.
# Matched as substrings of torch.cuda.get_device_name() in this order, so longer names come
# first ("H100 NVL" before "H100", "A100" before "A10G" before "A10", "L40S" before "L4").
_PEAK_TFLOPS: tuple[tuple[str, tuple[float | None, float | None, float | None, float | None]], ...] = (
    ("GH200", (989.0, 989.0, 494.7, 66.9)),
    ("H200 NVL", (835.5, 835.5, 417.5, 60.0)),
    ("H200", (989.0, 989.0, 494.7, 66.9)),
    ("H100 NVL", (835.5, 835.5, 417.5, 60.0)),
    ("H100 PCIe", (756.0, 756.0, 378.0, 51.2)),
    ("H100", (989.0, 989.0, 494.7, 66.9)),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H800", (989.0, 989.0, 494.7, 66.9)),
    ("H20", (148.0, 148.0, 74.0, 44.0)),
    ("B200", (2250.0, 2250.0, 1125.0, 75.0)),
    ("A100", (312.0, 312.0, 156.0, 19.5)),
    ("A10G", (70.0, 70.0, 35.0, 35.0)),  # AWS g5: less tensor throughput than the A10
    ("A10", (125.0, 125.0, 62.5, 31.2)),
    ("A30", (165.0, 165.0, 82.0, 10.3)),
    ("A40", (149.7, 149.7, 74.8, 37.4)),
    ("RTX A6000", (154.8, 154.8, 77.4, 38.7)),
    ("L40S", (362.0, 362.0, 183.0, 91.6)),
    ("L40", (181.0, 181.0, 90.5, 90.5)),
    ("L4", (121.0, 121.0, 60.0, 30.3)),
    ("RTX 4090", (165.2, 165.2, 82.6, 82.6)),
    ("RTX 3090", (71.0, 71.0, 35.6, 35.6)),
    ("V100S", (None, 130.0, None, 16.4)),
    ("V100-PCIE", (None, 112.0, None, 14.0)),
    ("V100", (None, 125.0, None, 15.7)),  # SXM2
    ("T4", (None, 65.0, None, 8.1)),
    ("MI300X", (1307.4, 1307.4, 653.7, 163.4)),
    ("MI325X", (1307.4, 1307.4, 653.7, 163.4)),
)
_DTYPE_COLUMN = {
    torch.bfloat16: 0, "bf16": 0, "bfloat16": 0,
    torch.float16: 1, "fp16": 1, "float16": 1,
    torch.float32: 3, "fp32": 3, "float32": 3,
}  # fmt: skip


def peak_memory_kind(device: torch.device | str) -> str:
    """The `peak_mem_kind` that `peak_memory_bytes(device)` measures: "rss" or "cuda_max_allocated"."""
    return "cuda_max_allocated" if torch.device(device).type == "cuda" else "rss"


def peak_memory_bytes(device: torch.device | str) -> int | None:
    """Peak memory of this process: CUDA `max_memory_allocated` on a GPU, else peak RSS.

    RSS comes from `resource.getrusage(RUSAGE_SELF).ru_maxrss`, which Linux reports in KiB and
    macOS in bytes. None where neither is measurable (Windows without CUDA).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)


def _tf32_matmul() -> bool:
    """Whether fp32 matmuls may use TF32 tensor cores, under either of torch's two APIs for it."""
    try:  # the newer per-backend API; reading the legacy flags after mixing both raises
        precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    except RuntimeError:
        precision = None
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return False


def peak_flops_for_name(name: str, dtype: torch.dtype | str, *, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of the GPU called `name` for `dtype`, or None when unknown."""
    column = _DTYPE_COLUMN.get(dtype)
    if column is None:
        return None
    if column == 3 and tf32:
        column = 2
    for pattern, rates in _PEAK_TFLOPS:
        if pattern.lower() in name.lower():
            rate = rates[column]
            if rate is None and column == 2:  # no TF32 before Ampere: fp32 matmuls run at the fp32 rate
                rate = rates[3]
            return None if rate is None else rate * 1e12
    return None


def device_peak_flops(device: torch.device | str, dtype: torch.dtype | str) -> float | None:
    """Dense peak FLOP/s of one `device` for `dtype` from a table of known GPUs; None on CPU or unknown."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return peak_flops_for_name(name, dtype, tf32=_tf32_matmul())


def transformer_flops_per_token(num_params: int, *, num_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder: 6N for the weights plus 12*L*d*T for attention.

    From PaLM (Chowdhery et al. 2022), appendix B, as nanoGPT's `estimate_mfu` uses it.
    `num_params` is the non-embedding parameter count (count a tied output head once).
    """
    return 6.0 * num_params + 12.0 * num_layers * dim * seq_len


def mfu(flops_per_token: float | None, tokens_per_s: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilization, 0..1: achieved FLOP/s over peak. None when any input is unknown.

    Pass one device's throughput (global tokens/s divided by world size) and one device's peak.
    """
    if not flops_per_token or not tokens_per_s or not peak or peak <= 0:
        return None
    return flops_per_token * tokens_per_s / peak


@dataclass(frozen=True)
class StepTiming:
    """One step as `StepTimer.stop` measured it."""

    step_time_s: float
    """Wall time from `start()` to `stop()`, data loading included."""
    tokens_per_s: float
    """Tokens this process consumed in the step, divided by `step_time_s`."""
    data_time_s: float | None = None
    """Time from `start()` to `data_done()`, when the loop marked it."""


class StepTimer:
    """Times steps and averages them, leaving out the first `warmup_steps` (allocator growth,
    autograd graph set-up and the first collectives make them slow).

        timer.start(); batch = next(it); timer.data_done(); ...; timing = timer.stop(num_tokens)

    On a GPU the clock only sees kernel launches unless something syncs before `stop()` (a
    `loss.item()` does); pass `sync=torch.cuda.synchronize` to force it.
    """

    def __init__(self, *, warmup_steps: int = 2, sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self._sync = sync
        self._clock = clock
        self._started: float | None = None
        self._data_done: float | None = None
        self._times: list[float] = []
        self._tokens: list[int] = []

    def start(self) -> None:
        self._started = self._clock()
        self._data_done = None

    def data_done(self) -> None:
        """Mark the end of data loading inside the current step (optional)."""
        self._data_done = self._clock()

    def stop(self, num_tokens: int) -> StepTiming:
        assert self._started is not None, "StepTimer.stop() without start()"
        if self._sync is not None:
            self._sync()
        elapsed = max(self._clock() - self._started, 1e-9)
        data = None if self._data_done is None else self._data_done - self._started
        self._started = None
        self._times.append(elapsed)
        self._tokens.append(num_tokens)
        return StepTiming(step_time_s=elapsed, tokens_per_s=num_tokens / elapsed, data_time_s=data)

    @property
    def num_steps(self) -> int:
        return len(self._times)

    def _measured(self) -> slice:
        # Fall back to every step when a run is shorter than its warmup: a biased number beats none.
        return slice(self.warmup_steps if len(self._times) > self.warmup_steps else 0, None)

    @property
    def mean_tokens_per_s(self) -> float | None:
        """Total tokens over total time of the steps after warmup (not a mean of per-step rates)."""
        times = self._times[self._measured()]
        return sum(self._tokens[self._measured()]) / sum(times) if times else None

    @property
    def median_step_time_s(self) -> float | None:
        times = self._times[self._measured()]
        return statistics.median(times) if times else None
