"""configure_allocator: freed buffers of FSDP's size go back to the OS, in a real process."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from meshrun.runtime.alloc import MemoryMarks, configure_allocator, peak_rss_bytes, rss_bytes

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"

# What FSDP does to the heap, in miniature: one large buffer freed (glibc then raises its mmap
# threshold to that size), then many all-gather-sized buffers, all freed except the newest,
# which pins the heap's top so that trimming cannot return the rest.
PROBE = """
import json, sys
import torch
from meshrun.runtime.alloc import configure_allocator, rss_bytes
configured = configure_allocator() if sys.argv[1] == "on" else False
big = torch.ones(8 << 20, dtype=torch.uint8)
del big
before = rss_bytes()
bufs = [torch.ones(2 << 20, dtype=torch.uint8) for _ in range(64)]   # 128 MiB, touched
keep = bufs[-1]
del bufs
print(json.dumps({"configured": configured, "held_mib": (rss_bytes() - before) / 2**20}))
"""


def _probe(mode: str, env: dict[str, str] | None = None) -> dict:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    full.update(env or {})
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         env=full, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only")
def test_freed_buffers_return_to_the_os_only_when_configured():
    off, on = _probe("off"), _probe("on")
    assert on["configured"] is True and off["configured"] is False
    assert off["held_mib"] > 64, f"glibc's defaults should keep the freed buffers here: {off}"
    assert on["held_mib"] < 16, f"configured, the freed buffers should be unmapped: {on}"


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only")
def test_the_users_own_malloc_settings_win():
    assert _probe("on", {"MALLOC_MMAP_THRESHOLD_": "33554432"})["configured"] is False


def test_memory_marks_are_peaks_above_the_runtime():
    marks = MemoryMarks()
    marks.mark_startup()
    marks.mark_first_step()
    marks.mark_trained()
    marks.mark_end()
    got = marks.gathered()  # no process group: this rank alone
    assert set(got) == {"rss_runtime_bytes", "rss_peak_startup_bytes", "rss_peak_first_step_bytes",
                        "rss_peak_trained_bytes", "rss_peak_bytes"}
    if rss_bytes() is not None:
        values = [got[name][0] for name in ("rss_runtime_bytes", "rss_peak_startup_bytes",
                                            "rss_peak_first_step_bytes", "rss_peak_trained_bytes",
                                            "rss_peak_bytes")]
        assert 0 < values[0] and values == sorted(values), values  # peaks only grow, from the runtime up
        assert values[-1] <= peak_rss_bytes()


def test_configure_allocator_is_a_no_op_off_glibc(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert configure_allocator() is False
