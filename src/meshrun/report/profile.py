"""Read the Chrome traces `meshrun train --profile` wrote (runs/<name>/profile/rank<N>.json): the
steps each holds, the operators with the most self CPU time, and the share of the profiled steps'
time during which a collective (all_reduce, reduce_scatter, all_gather, broadcast, ...) was running.

A trace is data from disk: its size is checked before it is parsed with `json`, and a file that is
too big, not JSON or not a Chrome trace is reported as such (`RankProfile.error`), never a crash.
"""

from __future__ import annotations

import html
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_DIR = "profile"  # meshrun.train.profile writes here (that module imports torch; this one must not)
STEP_LABEL = "ProfilerStep#"
MAX_TRACE_BYTES = 256 * 2**20
TOP_OPS = 10
# c10d ops (c10d::allreduce_), the backends' own spans (gloo:all_reduce, nccl:all_reduce) and
# functional collectives (_c10d_functional::all_gather_into_tensor), but not DDP's reducer helpers.
COLLECTIVE = re.compile(r"^(c10d::|_c10d_functional::|gloo:|nccl:|record_param_comms)|"
                        r"all_?reduce|reduce_?scatter|all_?gather|all_to_all|broadcast|barrier",
                        re.IGNORECASE)
_SPAN_CATS = {"cpu_op", "user_annotation", "gpu_user_annotation", "kernel"}


@dataclass
class RankProfile:
    """One rank's trace, summarised."""

    rank: int
    path: Path
    steps: list[int] = field(default_factory=list)
    step_time_us: float = 0.0
    collective_us: float = 0.0
    top_ops: list[tuple[str, float, int]] = field(default_factory=list)  # (name, self µs, calls)
    error: str | None = None

    @property
    def collective_share(self) -> float | None:
        return self.collective_us / self.step_time_us if self.step_time_us > 0 else None


def _load(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    if size > MAX_TRACE_BYTES:
        raise ValueError(f"{size / 2**20:.0f} MiB, over the {MAX_TRACE_BYTES // 2**20} MiB the report reads; "
                         "profile fewer steps, or open it in a trace viewer")
    with path.open(encoding="utf-8", errors="replace") as stream:
        data = json.load(stream)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError("not a Chrome trace (no traceEvents list)")
    return data


def _spans(events: list[Any]) -> list[dict[str, Any]]:
    """The complete ('X') events with a numeric start and duration."""
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
            and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))
            and isinstance(e.get("name"), str)]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _self_times(spans: list[dict[str, Any]]) -> dict[str, list[float]]:
    """{op name: [self µs, calls]}: each span's duration minus its direct children's, per thread."""
    totals: dict[str, list[float]] = {}
    by_thread: dict[Any, list[dict[str, Any]]] = {}
    for span in spans:
        if span.get("cat") in _SPAN_CATS and not span["name"].startswith(STEP_LABEL):
            by_thread.setdefault((span.get("pid"), span.get("tid")), []).append(span)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list[Any]] = []  # [end, name, self time]
        for span in thread:
            start, end = span["ts"], span["ts"] + span["dur"]
            while stack and stack[-1][0] <= start:
                _done(totals, stack.pop())
            if stack:
                stack[-1][2] -= min(end, stack[-1][0]) - start
            stack.append([end, span["name"], span["dur"]])
        while stack:
            _done(totals, stack.pop())
    return totals


def _done(totals: dict[str, list[float]], entry: list[Any]) -> None:
    row = totals.setdefault(entry[1], [0.0, 0])
    row[0] += max(entry[2], 0.0)
    row[1] += 1


def read_profile(path: Path, rank: int) -> RankProfile:
    profile = RankProfile(rank, path)
    try:
        spans = _spans(_load(path)["traceEvents"])
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        profile.error = str(exc) if not isinstance(exc, OSError) else (exc.strerror or str(exc))
        return profile
    steps = [e for e in spans if e["name"].startswith(STEP_LABEL) and e["name"][len(STEP_LABEL):].isdigit()]
    profile.steps = sorted(int(e["name"][len(STEP_LABEL):]) for e in steps)
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
    profile.step_time_us = _union_us(windows)
    clipped = [(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in spans if COLLECTIVE.search(e["name"])
               for lo, hi in windows if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    profile.collective_us = _union_us(clipped)
    totals = _self_times(spans)
    top = sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)[:TOP_OPS]
    profile.top_ops = [(name, us, int(calls)) for name, (us, calls) in top]
    return profile


def read_profiles(run_dir: str | Path) -> list[RankProfile]:
    """Every rank<N>.json under run_dir/profile/, by rank; [] when the run was not profiled."""
    found = []
    for path in sorted((Path(run_dir) / PROFILE_DIR).glob("rank*.json")):
        suffix = path.stem.removeprefix("rank")
        if suffix.isdigit() and path.is_file():
            found.append(read_profile(path, int(suffix)))
    return sorted(found, key=lambda p: p.rank)


def _ms(us: float) -> str:
    return f"{us / 1000:.2f} ms"


def _steps(profile: RankProfile) -> str:
    if not profile.steps:
        return "no steps"
    first, last = profile.steps[0], profile.steps[-1]
    return f"step {first}" if first == last else f"steps {first}-{last}"


def profile_lines(profiles: list[RankProfile]) -> list[str]:
    """One line per rank for the terminal: steps, collective share and the top 3 operators."""
    lines = []
    for p in profiles:
        if p.error:
            lines.append(f"rank {p.rank}: {p.path} unreadable: {p.error}")
            continue
        share = p.collective_share
        ops = ", ".join(f"{name} {_ms(us)}" for name, us, _ in p.top_ops[:3])
        lines.append(f"rank {p.rank}: {_steps(p)}, {_ms(p.step_time_us)} profiled, "
                     f"{'?' if share is None else f'{share:.1%}'} in collectives; top self CPU: {ops}")
    return lines


def profile_html(profiles: list[RankProfile], out_dir: Path) -> str:
    """The report's Profile section: a link to each trace, its collective share and top operators."""
    if not profiles:
        return ""
    parts = ['<h2>Profile</h2><p class="note">Chrome traces from <code>--profile</code>: open one in '
             'https://ui.perfetto.dev or chrome://tracing. Self CPU time per operator; collectives = '
             'share of the profiled steps during which a collective ran.</p>']
    for p in profiles:
        link = html.escape(os.path.relpath(p.path, out_dir))
        head = f'<h3>rank {p.rank}: <a href="{link}">{html.escape(p.path.name)}</a></h3>'
        if p.error:
            parts.append(f'{head}<p class="note">unreadable: {html.escape(p.error)}</p>')
            continue
        share = p.collective_share
        rows = "".join(f"<tr><td>{html.escape(name)}</td><td>{us / 1000:.3f}</td><td>{calls}</td></tr>"
                       for name, us, calls in p.top_ops)
        parts.append(f"{head}<p>{_steps(p)}, {_ms(p.step_time_us)} profiled, "
                     f"{'?' if share is None else f'{share:.1%}'} of it in collectives</p>"
                     f"<table><tr><th>operator</th><th>self CPU ms</th><th>calls</th></tr>{rows}</table>")
    return "\n".join(parts)
