"""`meshrun report`: a run's loss, throughput and per-rank step-time curves as PNG/SVG and one HTML page."""

from __future__ import annotations

from meshrun.report.ranks import Straggler, find_straggler, rank_stats
from meshrun.report.render import Report, render_report, write_report
from meshrun.report.run import ReportError, RunData, load_run

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
