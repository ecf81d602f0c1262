"""The report's line charts: PNG through matplotlib's Agg canvas, or hand-written SVG without it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

WIDTH, HEIGHT = 760, 380
LEFT, RIGHT, TOP, BOTTOM = 72, 16, 36, 60
MAX_POINTS = 2000  # per series; longer series are strided so the page stays small
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # matplotlib's tab10


@dataclass
class Series:
    label: str
    xs: list[float]
    ys: list[float]
    markers: bool = False
    """Draw a dot at each point (sparse series such as eval loss)."""


@dataclass
class Chart:
    name: str
    """File stem: loss, throughput, ranks."""
    title: str
    xlabel: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    note: str | None = None
    """One line under the chart (the straggler verdict, the median MFU)."""
    y_from_zero: bool = False
    """Start the y axis at 0 (rates and times: gaps read in proportion)."""
    marks: list[float] = field(default_factory=list)
    """Steps to mark with a dashed vertical line labelled "resumed" (where the run restarted)."""
    failures: list[float] = field(default_factory=list)
    """Steps to mark with a dotted vertical line labelled "failed" (the last step before a failure)."""


def format_number(value: float) -> str:
    """Short axis and table numbers: 0.25, 3.142, 12.5k, 1.2M."""
    if not math.isfinite(value):
        return ""
    size = abs(value)
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if size >= scale:
            return f"{value / scale:.3g}{suffix}"
    if size == 0:
        return "0"
    return f"{value:.1e}" if size < 1e-3 else f"{value:.4g}"


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values (steps of 1, 2, 2.5 or 5 x 10^k) covering [low, high]."""
    if high <= low:  # one point, or one value: a unit-wide axis around it
        low, high = low - 0.5, low + 0.5
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first, last = math.floor(low / step), math.ceil(high / step)
    return [round(i * step, 12) for i in range(first, last + 1)]


def _strided(series: Series) -> tuple[list[float], list[float]]:
    stride = max(1, math.ceil(len(series.xs) / MAX_POINTS))
    return series.xs[::stride], series.ys[::stride]


def render_svg(chart: Chart) -> str:
    """A standalone <svg> element: axes with round ticks, one polyline per series, a legend, the note."""
    width, height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
           f'height="{HEIGHT}" role="img" aria-label="{escape(chart.title)}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="15">{escape(chart.title)}</text>']
    xs = [x for s in chart.series for x in s.xs]
    ys = [y for s in chart.series for y in s.ys if math.isfinite(y)]
    if not xs or not ys:
        out.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" fill="gray">no data</text>')
    else:
        low = min(0.0, min(ys)) if chart.y_from_zero else min(ys)
        xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(low, max(ys) + 0.04 * (max(ys) - low))

        def px(x: float) -> float:
            return LEFT + (x - xt[0]) / (xt[-1] - xt[0]) * width

        def py(y: float) -> float:
            return TOP + height - (y - yt[0]) / (yt[-1] - yt[0]) * height

        for x in xt:
            out.append(f'<line x1="{px(x):.1f}" y1="{TOP}" x2="{px(x):.1f}" y2="{TOP + height}" stroke="#eee"/>'
                       f'<text x="{px(x):.1f}" y="{TOP + height + 15}" text-anchor="middle">'
                       f'{format_number(x)}</text>')
        for y in yt:
            out.append(f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{LEFT + width}" y2="{py(y):.1f}" stroke="#eee"/>'
                       f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{format_number(y)}</text>')
        legend = []
        if len(chart.series) > 1:  # top right inside the plot, over a white box
            legend.append(f'<rect x="{LEFT + width - 136}" y="{TOP + 4}" width="132" '
                          f'height="{15 * len(chart.series) + 6}" fill="white" fill-opacity="0.85"/>')
        for index, series in enumerate(chart.series):
            color = COLORS[index % len(COLORS)]
            points = [(px(x), py(y)) for x, y in zip(*_strided(series), strict=True) if math.isfinite(y)]
            coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>')
            if series.markers:
                out.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in points)
            if legend:
                ly = TOP + 14 + 15 * index
                legend.append(f'<line x1="{LEFT + width - 130}" y1="{ly - 4}" x2="{LEFT + width - 110}" '
                              f'y2="{ly - 4}" stroke="{color}" stroke-width="2"/>'
                              f'<text x="{LEFT + width - 104}" '
                              f'y="{ly}">{escape(series.label)}</text>')
        for marks, color, dash, label, dy in ((chart.marks, "#d62728", "4 3", "resumed", 12),
                                              (chart.failures, "#ff7f0e", "1 3", "failed", 24)):
            for x in marks:
                if xt[0] <= x <= xt[-1]:
                    out.append(f'<line x1="{px(x):.1f}" y1="{TOP}" x2="{px(x):.1f}" y2="{TOP + height}" '
                               f'stroke="{color}" stroke-dasharray="{dash}"/><text x="{px(x) + 3:.1f}" '
                               f'y="{TOP + dy}" fill="{color}">{label}</text>')
        out.extend(legend)
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{width}" height="{height}" fill="none" stroke="#888"/>'
               f'<text x="{LEFT + width / 2}" y="{TOP + height + 32}" text-anchor="middle">'
               f'{escape(chart.xlabel)}</text>'
               f'<text transform="translate(16 {TOP + height / 2}) rotate(-90)" text-anchor="middle">'
               f'{escape(chart.ylabel)}</text>')
    if chart.note:
        out.append(f'<text x="8" y="{HEIGHT - 8}" fill="#555">{escape(chart.note)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def render_png(chart: Chart, path: Path) -> None:
    """Draw `chart` to `path` with matplotlib's Agg canvas (no pyplot: no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(8, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for series in chart.series:
        ax.plot(series.xs, series.ys, label=series.label, marker="o" if series.markers else None,
                markersize=4, linewidth=1.4)
    for index, x in enumerate(chart.marks):
        ax.axvline(x, color="#d62728", linestyle="--", linewidth=1, label=None if index else "resumed")
    for index, x in enumerate(chart.failures):
        ax.axvline(x, color="#ff7f0e", linestyle=":", linewidth=1.2, label=None if index else "failed")
    if not chart.series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_title(chart.title)
    ax.set_xlabel(chart.xlabel)
    ax.set_ylabel(chart.ylabel)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: format_number(value)))
    ax.grid(alpha=0.3)
    if chart.y_from_zero and chart.series:
        ax.set_ylim(bottom=0)
    if len(chart.series) > 1 or chart.marks or chart.failures:
        ax.legend(fontsize=8)
    if chart.note:
        fig.text(0.01, 0.01, chart.note, fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, 0.04 if chart.note else 0, 1, 1))
    fig.savefig(path, format="png")
