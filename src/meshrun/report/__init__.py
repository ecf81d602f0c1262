"""`meshrun report`: a run's loss, throughput and per-rank step-time curves as PNG/SVG and one HTML page."""

from __future__ import annotations

from meshrun.report.render import (
    Report,
    ReportError,
    RunData,
    Straggler,
    find_straggler,
    load_run,
    rank_stats,
    render_report,
    write_report,
)

__all__ = [
    "Report",
    "ReportError",
    "RunData",
    "Straggler",
    "find_straggler",
    "load_run",
    "rank_stats",
    "render_report",
    "write_report",
]
