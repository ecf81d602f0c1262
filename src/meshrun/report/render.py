"""Render a run's curves (loss, throughput, per-rank step times) as PNG, or SVG, plus one report.html.

    meshrun report runs/<name> [--out DIR]

PNGs need matplotlib (`pip install matplotlib`); without it the same charts are drawn as
hand-written SVG inside the HTML, so a report is always produced.
"""

from __future__ import annotations

import base64
import html
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrun.metrics.logger import METRICS_FILE, RANKS_DIR
from meshrun.report.charts import (
    Chart,
    Series,
    format_number,
    matplotlib_available,
    render_png,
    render_svg,
)
from meshrun.report.profile import RankProfile, profile_html, read_profiles
from meshrun.report.ranks import RankStats, Straggler, find_straggler, median_of, rank_stats
from meshrun.report.run import ReportError, RunData, load_run

logger = logging.getLogger(__name__)

MAX_RANK_LINES = 8  # more ranks than this: plot the slowest, the fastest and the median across ranks


def _series(records: list[dict[str, Any]], key: str, label: str, **style: Any) -> Series | None:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return Series(label, [p[0] for p in points], [p[1] for p in points], **style) if points else None


def _local_time_s(row: dict[str, Any]) -> float | None:
    """Rank-local work of one step: compute_time_s plus data_time_s when logged."""
    compute, data = row.get("compute_time_s"), row.get("data_time_s")
    if not isinstance(compute, (int, float)):
        return None
    return compute + (data if isinstance(data, (int, float)) else 0.0)


def _rank_chart(run: RunData, straggler: Straggler | None) -> Chart:
    """One line per rank of the straggler metric; with many ranks, the extremes and the median."""
    local = straggler is not None and straggler.metric == "local_time_s"
    points = {rank: [(row["step"], _local_time_s(row) if local else row["step_time_s"]) for row in rows]
              for rank, rows in run.ranks.items()}
    points = {rank: [(x, y) for x, y in pts if y is not None] for rank, pts in points.items()}
    series = [Series(f"rank {rank}", [x for x, _ in pts], [y for _, y in pts]) for rank, pts in points.items()]
    if len(series) > MAX_RANK_LINES and straggler is not None:
        by_step: dict[int, list[float]] = {}
        for pts in points.values():
            for x, y in pts:
                by_step.setdefault(x, []).append(y)
        steps = sorted(by_step)
        keep = {f"rank {straggler.slowest}", f"rank {straggler.fastest}"}
        series = [s for s in series if s.label in keep] + [
            Series(f"median of {len(points)} ranks", steps, [statistics.median(by_step[x]) for x in steps])]
    # The verdict on the ranks (balanced, or which one straggles) is said once, in the summary table.
    note = None if straggler else ("one rank: nothing to compare" if run.ranks
                                   else f"no {RANKS_DIR}/rank<N>.jsonl files")
    title = "Local work per rank (data + compute)" if local else "Step time per rank"
    return Chart("ranks", title, "step", "seconds", [s for s in series if s.xs], note, y_from_zero=True)


def build_charts(run: RunData, straggler: Straggler | None) -> list[Chart]:
    """The charts: loss, throughput, ranks, lr and grad_norm (.png or .svg), and expert_load for a
    mixture of experts; every step chart marks the steps the run resumed from and the last step
    before each failure."""
    loss = [s for s in (_series(run.train, "loss", "train loss"),
                        _series(run.eval, "eval_loss", "eval loss", markers=True)) if s]
    mfus = [r["mfu"] for r in run.train if isinstance(r.get("mfu"), (int, float))]
    throughput = [s for s in (_series(run.train, "tokens_per_s", "tokens/s"),) if s]
    lr = [s for s in (_series(run.train, "lr", "learning rate"),) if s]
    grad = [s for s in (_series(run.train, "grad_norm", "gradient norm"),) if s]
    charts = [
        Chart("loss", "Loss", "step", "loss", loss, None if loss else "no loss values logged"),
        Chart("throughput", "Throughput", "step", "tokens/s", throughput,
              f"median MFU {statistics.median(mfus):.1%}" if mfus else None, y_from_zero=True),
        _rank_chart(run, straggler),
        Chart("lr", "Learning rate", "step", "lr", lr, None if lr else "no lr values logged", y_from_zero=True),
        Chart("grad_norm", "Gradient norm (before clipping)", "step", "norm", grad,
              None if grad else "no grad_norm values logged", y_from_zero=True),
    ]
    load = _series(run.train, "moe_load_max_over_mean", "worst MoE layer")
    if load is not None:  # a mixture of experts (meshrun.models.moe): 1 = every expert equally loaded
        charts.append(Chart("expert_load", "Expert load (max / mean tokens per expert)", "step",
                            "max / mean", [load], None, y_from_zero=True))
    for chart in charts:
        chart.marks = list(run.resumed_at) if chart.series else []
        chart.failures = [r.failed_after for r in run.recoveries] if chart.series else []
    return charts


def _meta_value(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_bytes"):
        return f"{value / 2**30:.2f} GiB"
    return str(value) if isinstance(value, int) and abs(value) < 10**6 else format_number(value)


# Meta keys the summary states in a row of its own (throughput, memory), or that are not settings.
_NOT_SETTINGS = ("kind", "time", "event", "tokens_per_s", "peak_mem_bytes", "start_step")


def _throughput(run: RunData) -> str | None:
    """One tokens/s figure, with its definition: the run's own total when it finished, else the median."""
    total = run.meta.get("tokens_per_s")
    if isinstance(total, (int, float)) and not isinstance(total, bool):
        return (f"{format_number(total)} (all ranks together: tokens trained / time spent in "
                "training steps, first 2 steps left out)")
    median = median_of(run.train, "tokens_per_s")
    if median is None:
        return None
    return f"{format_number(median)} (all ranks together: median over the logged steps; the run has no end record)"


def _peak_memory(run: RunData, stats: list[RankStats]) -> str | None:
    """Peak memory, once: per rank when the ranks logged it, else rank 0's logged peak."""
    peaks = [r for r in run.train if isinstance(r.get("peak_mem_bytes"), (int, float))]
    kind = peaks[-1].get("peak_mem_kind", "unknown kind") if peaks else "rss"
    mems = {s.rank: s.peak_mem_bytes for s in stats if s.peak_mem_bytes is not None}
    if mems:
        top, low = max(mems, key=mems.get), min(mems, key=mems.get)
        return (f"{mems[top] / 2**30:.2f} GiB on rank {top} (most), {mems[low] / 2**30:.2f} GiB "
                f"on rank {low} (least); {kind}")
    if peaks:
        peak = max(r["peak_mem_bytes"] for r in peaks)
        return f"{peak / 2**30:.2f} GiB on rank 0; {kind}"
    return None


def summary_rows(run: RunData, stats: list[RankStats], straggler: Straggler | None) -> list[tuple[str, str]]:
    """(label, value) rows of the summary table."""
    rows = [("run", run.name)]
    rows += [(key, _meta_value(key, value)) for key, value in run.meta.items()
             if key not in _NOT_SETTINGS and not key.startswith("rss_") and isinstance(value, (str, int, float, bool))]
    if run.train:
        rows.append(("steps", f"{run.train[-1]['step']} ({len(run.train)} train records)"))
        losses = [r["loss"] for r in run.train if isinstance(r.get("loss"), (int, float))]
        if losses:
            rows.append(("train loss", f"{losses[0]:.4f} first, {losses[-1]:.4f} final"))
    evals = [r for r in run.eval if isinstance(r.get("eval_loss"), (int, float))]
    if evals:
        best = min(evals, key=lambda r: r["eval_loss"])
        rows.append(("eval loss", f"{evals[-1]['eval_loss']:.4f} final (step {evals[-1]['step']}), "
                                  f"{best['eval_loss']:.4f} best (step {best['step']}), "
                                  f"{evals[0]['eval_loss']:.4f} first"))
    throughput = _throughput(run)
    if throughput:
        rows.append(("tokens/s", throughput))
    for key, label, fmt in (("step_time_s", "median step time", lambda v: f"{v:.4g} s"),
                            ("mfu", "median MFU", lambda v: f"{v:.1%}")):
        value = median_of(run.train, key)
        if value is not None:
            rows.append((label, fmt(value)))
    memory = _peak_memory(run, stats)
    if memory:
        rows.append(("peak memory", memory))
    if stats:
        rows.append(("ranks", f"{len(stats)} with step times"))
    if straggler:
        rows.append(("slowest rank", straggler.note))
    for row in run.stragglers:  # named live by the trainer (metrics/stragglers.py): when it began and ended
        if row.get("event") == "straggler":
            share = row.get("data_share")
            share = f", data wait {share:.0%} of it" if isinstance(share, (int, float)) else ""
            rows.append(("straggler", f"rank {row.get('rank')} from step {row.get('step')}: "
                                      f"{row.get('ratio')}x the others' median own work{share}"))
        else:
            rows.append(("straggler", f"rank {row.get('rank')} no longer from step {row.get('step')}"))
    times = [r["time"] for r in run.train + run.eval if isinstance(r.get("time"), (int, float))]
    if len(times) > 1:
        rows.append(("wall time", f"{max(times) - min(times):.1f} s between the first and last record"))
    if run.resumed_at:
        rows.append(("resumed", ", ".join(f"at step {step}" for step in run.resumed_at)))
    for index, recovery in enumerate(run.recoveries, 1):
        rows.append((f"recovery {index}", recovery.describe()))
    if run.goodput is not None:
        rows.append(("goodput", f"{run.goodput:.3f} (estimated from this run's records: "
                                "benchmarks/goodput.py measures it against a fault-free run)"))
    if run.skipped_lines:
        rows.append(("skipped lines", f"{run.skipped_lines} (not JSON, or no step)"))
    return rows


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>meshrun report: {name}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:60em;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:left}}
th{{background:#f4f4f4}}figure{{margin:1.5em 0}}img,svg{{max-width:100%;height:auto}}
.note{{color:#555;font-size:.9em}}</style></head><body>
<h1>meshrun report: {name}</h1>
<table>{summary}</table>
{figures}
<h2>Ranks</h2>
{ranks}
{profile}
</body></html>
"""


def _figure(chart: Chart, image: Path | None) -> str:
    if image is None:
        body = render_svg(chart)
    else:  # inline so the page travels alone; the link opens the file next to it
        data = base64.b64encode(image.read_bytes()).decode("ascii")
        body = (f'<a href="{html.escape(image.name)}"><img alt="{html.escape(chart.title)}" '
                f'src="data:image/png;base64,{data}"></a>')
    note = f'<figcaption class="note">{html.escape(chart.note)}</figcaption>' if chart.note else ""
    return f"<figure>{body}{note}</figure>"


def _rank_table(stats: list[RankStats]) -> str:
    if not stats:
        return '<p class="note">No per-rank step times were logged.</p>'

    def value_of(stat: RankStats, key: str) -> float | None:
        if key == "peak_mem_gib":
            return None if stat.peak_mem_bytes is None else stat.peak_mem_bytes / 2**30
        return getattr(stat, key)

    columns = [("rank", "rank"), ("steps", "num_steps"), ("median step s", "median_step_s"),
               ("p90 step s", "p90_step_s"), ("median data s", "median_data_s"),
               ("median compute s", "median_compute_s"), ("peak mem GiB", "peak_mem_gib")]
    columns = [(h, key) for h, key in columns if any(value_of(s, key) is not None for s in stats)]

    def cell(value: float | None) -> str:
        return "" if value is None else str(value) if isinstance(value, int) else f"{value:.4g}"

    head = "".join(f"<th>{h}</th>" for h, _ in columns)
    rows = "".join("<tr>" + "".join(f"<td>{cell(value_of(s, key))}</td>" for _, key in columns) + "</tr>"
                   for s in stats)
    return f"<table><tr>{head}</tr>{rows}</table>"


@dataclass
class Report:
    """What `write_report` wrote."""

    html: Path
    images: list[Path]
    image_format: str
    straggler: Straggler | None
    skipped_lines: int
    profiles: list[RankProfile] = field(default_factory=list)


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, *,
                 image_format: str = "auto") -> Report:
    """Charts and report.html for a run. image_format: "png" (needs matplotlib), "svg", or
    "auto" (png when matplotlib imports, else svg)."""
    if image_format not in ("auto", "png", "svg"):
        raise ReportError(f"image format must be auto, png or svg, got {image_format!r}")
    run = load_run(run_dir)
    have_mpl = image_format != "svg" and matplotlib_available()  # svg: matplotlib is not even imported
    if image_format == "png" and not have_mpl:
        raise ReportError("PNG charts need matplotlib: pip install matplotlib (or use SVG charts)")
    fmt = "png" if image_format == "png" or (image_format == "auto" and have_mpl) else "svg"
    if image_format == "auto" and not have_mpl:
        logger.info("matplotlib is not installed: charts are SVG (pip install matplotlib for PNGs)")
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    if out.is_file() and out.name == METRICS_FILE:
        out = out.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        stats = rank_stats(run.ranks)
        straggler = find_straggler(stats)
        charts = build_charts(run, straggler)
        images: list[Path] = []
        for chart in charts:
            images.append(out / f"{chart.name}.{fmt}")
            if fmt == "png":
                render_png(chart, images[-1])
            else:
                images[-1].write_text(render_svg(chart), encoding="utf-8")
        summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                          for k, v in summary_rows(run, stats, straggler))
        figures = "\n".join(_figure(c, p if fmt == "png" else None) for c, p in zip(charts, images, strict=True))
        page = out / "report.html"
        profiles = read_profiles(run_dir if Path(run_dir).is_dir() else Path(run_dir).parent)
        page.write_text(_PAGE.format(name=html.escape(run.name), summary=summary, figures=figures,
                                     ranks=_rank_table(stats), profile=profile_html(profiles, out)),
                        encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"cannot write the report to {out}: {exc.strerror or exc}") from exc
    return Report(html=page, images=images, image_format=fmt, straggler=straggler,
                  skipped_lines=run.skipped_lines, profiles=profiles)


def render_report(run_dir: str | Path, out_dir: str | Path | None = None, image_format: str = "auto") -> Path:
    """Write the charts and report.html for `run_dir` (into it by default); return report.html's path.

    The trainer calls this at the end of a run (image_format: `metrics.charts`) so the run
    directory holds its curves.
    """
    return write_report(run_dir, out_dir, image_format=image_format).html
