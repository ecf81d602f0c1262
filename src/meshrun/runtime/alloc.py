"""Host memory of a worker: return freed buffers to the OS (glibc malloc), and measure what is held.

Why: on CPU, FSDP all-gathers a block's parameters before its forward and frees them after;
gradients are reduce-scattered the same way. Those buffers are megabytes each. With glibc's
defaults a freed buffer of that size goes back to malloc's heap, not to the OS: the default
mmap threshold (128 KiB) rises to the size of every large block freed (up to 32 MiB), so the
next ones come from the heap, and the heap is trimmed only from its top. A sharded rank then
keeps the memory of a whole model's worth of gathers, and FSDP saves nothing measurable.
Fixing the mmap threshold (which also stops its dynamic adjustment) makes every buffer at or
above it a private mapping that `free` unmaps at once (mallopt(3), M_MMAP_THRESHOLD).
Measured in docs/parallel.md ("Memory on CPU") with benchmarks/memory.py.

    from meshrun.runtime.alloc import configure_allocator
    configure_allocator()        # once, at worker start; a no-op off glibc
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys

# mallopt(3) parameter number, from glibc's <malloc.h>.
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 256 << 10
"""Buffers of 256 KiB and more are mmap'ed and unmapped on free. Measured with
benchmarks/memory.py (model base, batch 1 x 128): at 1 MiB an FSDP-2 rank still peaked at 0.61x
one process, because activations of this size (128 x 768 fp32 = 384 KiB) stayed on the heap
and fragmented it; at 256 KiB, 0.56x. Setting the threshold also fixes the trim threshold at
its 128 KiB default (glibc stops adjusting both)."""


def configure_allocator(*, mmap_threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc malloc's mmap threshold for this process; True when it was set.

    A no-op (False) off Linux/glibc (musl, macOS, Windows), and when the user set
    `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` in the environment: theirs wins.
    """
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold))  # 1 on success, 0 on error


def rss_bytes() -> int | None:
    """Resident memory of this process now (Linux /proc/self/statm); None where unreadable."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int | None:
    """Peak resident memory of this process so far (getrusage's ru_maxrss); None where unknown."""
    try:
        import resource
    except ImportError:
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = int(maxrss if sys.platform == "darwin" else maxrss * 1024)
    # The kernel updates its high-water mark lazily: the resident size now can be above it.
    return max(peak, rss_bytes() or 0)


class MemoryMarks:
    """Resident memory of one rank at the points of a run that tell whether sharding works.

    Created when the runtime is up and before the model exists (`runtime`); `mark_startup`
    after the model, optimizer and checkpoint are in place; `mark_first_step` after the first
    optimizer step; `mark_trained` after the last; `mark_end` after the final weights are
    saved (rank 0 gathers the whole model there). Each mark is the process's peak so far, so "above
    the runtime" is `mark - runtime`. Cheap: a file read or a getrusage call each.
    """

    def __init__(self) -> None:
        self.runtime = rss_bytes()
        self.startup: int | None = None
        self.first_step: int | None = None
        self.trained: int | None = None
        self.end: int | None = None

    def mark_startup(self) -> None:
        self.startup = peak_rss_bytes()

    def mark_first_step(self) -> None:
        self.first_step = peak_rss_bytes()

    def mark_trained(self) -> None:
        self.trained = peak_rss_bytes()

    def mark_end(self) -> None:
        self.end = peak_rss_bytes()

    def gathered(self) -> dict[str, list[int | None]]:
        """Every rank's marks, by rank, for rank 0's metrics (a collective: every rank calls it)."""
        mine = [self.runtime, self.startup, self.first_step, self.trained, self.end]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks: list = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        names = ("rss_runtime_bytes", "rss_peak_startup_bytes", "rss_peak_first_step_bytes",
                 "rss_peak_trained_bytes", "rss_peak_bytes")
        return {name: [r[i] for r in ranks] for i, name in enumerate(names)}
