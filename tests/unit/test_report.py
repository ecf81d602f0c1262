"""meshrun.report and `meshrun report`: charts and report.html from synthetic metrics."""

from __future__ import annotations

import json
import math
import sys

import pytest

from meshrun.cli import report as report_cli
from meshrun.errors import MeshrunError
from meshrun.metrics import MetricsLogger
from meshrun.report import find_straggler, load_run, rank_stats, render_report, write_report
from meshrun.report.charts import nice_ticks
from meshrun.report.render import build_charts

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_run(run_dir, *, num_ranks=4, slow_rank=2, steps=40, compute_only=False):
    """A run as the trainer writes it: train lines every 2 steps, eval every 10, rank step times.

    compute_only: every rank's step time is equal (synchronous training) and only its
    compute_time_s shows who is slow.
    """
    loggers = [MetricsLogger(run_dir, rank=rank, tensorboard=False) for rank in range(num_ranks)]
    loggers[0].log_meta(world_size=num_ranks, device="cpu")
    for step in range(1, steps + 1):
        loss = 1.0 + 4.0 * math.exp(-step / 10)
        for rank, metrics in enumerate(loggers):
            jitter = 0.001 * ((step * 7 + rank) % 5)
            slow = 0.05 if rank == slow_rank else 0.0
            if compute_only:
                metrics.log_rank_step(step, step_time_s=0.2 + jitter, data_time_s=0.01,
                                      compute_time_s=0.1 + slow + jitter)
            else:
                metrics.log_rank_step(step, step_time_s=0.1 + slow + jitter, data_time_s=0.01,
                                      peak_mem_bytes=(rank + 1) * 2**30 if step % 10 == 0 else None)
        if step % 2 == 0:
            loggers[0].log_train(step, loss=loss, lr=1e-3, tokens_per_s=5000.0 + step,
                                 step_time_s=0.1, peak_mem_bytes=3 * 2**30, peak_mem_kind="rss")
        if step % 10 == 0:
            loggers[0].log_eval(step, eval_loss=loss + 0.2 - step / 1000)
    loggers[0].log_meta(event="end", tokens_per_s=5020.5, peak_mem_bytes=3 * 2**30, num_params=1234567)
    for metrics in loggers:
        metrics.close()
    return run_dir


def cli(argv, capsys):
    """`meshrun report ARGV` as the dispatcher runs it: a MeshrunError is one line and exit 2."""
    try:
        code = report_cli.main(argv)
    except MeshrunError as exc:
        print(f"meshrun report: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError


def test_png_report_has_five_charts_and_an_html_page_that_references_them(tmp_path):
    pytest.importorskip("matplotlib")
    run = make_run(tmp_path / "runs" / "demo")
    page = render_report(run)
    assert page == run / "report.html"
    for name in ("loss", "throughput", "ranks", "lr", "grad_norm"):
        assert (run / f"{name}.png").read_bytes()[:8] == PNG_SIGNATURE
    text = page.read_text()
    for name in ("loss.png", "throughput.png", "ranks.png", "lr.png", "grad_norm.png"):
        assert f'href="{name}"' in text
    assert text.count("data:image/png;base64,") == 5  # the page also travels alone
    assert text.count("rank 2 is a straggler") == 1 and text.count(">tokens/s<") == 1
    assert "4.00 GiB on rank 3 (most)" in text
    assert "best (step 40)" in text and "<h1>meshrun report: demo</h1>" in text


def test_summary_names_steps_eval_losses_throughput_and_memory(tmp_path):
    run = load_run(make_run(tmp_path / "run"))
    from meshrun.report.render import summary_rows

    rows = dict(summary_rows(run, rank_stats(run.ranks), find_straggler(rank_stats(run.ranks))))
    assert rows["steps"] == "40 (20 train records)"
    assert rows["eval loss"].startswith(f"{1.0 + 4.0 * math.exp(-4) + 0.2 - 0.04:.4f} final (step 40)")
    assert "best (step 40)" in rows["eval loss"]
    assert rows["world_size"] == "4" and "event" not in rows
    # each thing once: one tokens/s figure with its definition, one peak memory row
    assert rows["tokens/s"].startswith("5.02k (all ranks together: tokens trained / time")
    assert not {"tokens_per_s", "peak_mem_bytes", "median tokens/s", "peak memory per rank"} & set(rows)
    assert rows["num_params"] == "1.23M"
    assert rows["slowest rank"].startswith("rank 2 is a straggler")
    assert rows["peak memory"] == "4.00 GiB on rank 3 (most), 1.00 GiB on rank 0 (least); rss"


def test_svg_fallback_without_matplotlib_still_writes_the_html(tmp_path, no_matplotlib, capsys):
    run = make_run(tmp_path / "run")
    code, out, err = cli([str(run), "--out", str(tmp_path / "out")], capsys)
    assert code == 0
    assert "report.html (loss.svg, throughput.svg, ranks.svg, lr.svg, grad_norm.svg)" in out
    assert "pip install matplotlib" in err
    text = (tmp_path / "out" / "report.html").read_text()
    assert text.count("<svg") == 5 and "<polyline" in text
    assert (tmp_path / "out" / "ranks.svg").read_text().startswith("<svg")
    assert not list(tmp_path.glob("out/*.png"))
    code, _, err = cli([str(run), "--format", "png"], capsys)
    assert code == 2 and err.strip().endswith("pip install matplotlib (or use SVG charts)")


def test_straggler_detection_picks_the_slow_rank(tmp_path):
    run = load_run(make_run(tmp_path / "run", slow_rank=1))
    straggler = find_straggler(rank_stats(run.ranks))
    assert straggler.slowest == 1 and straggler.is_straggler and straggler.metric == "step_time_s"
    assert straggler.ratio == pytest.approx(0.152 / 0.102, rel=0.05)


def test_straggler_in_synchronous_steps_is_found_by_compute_time(tmp_path):
    run = load_run(make_run(tmp_path / "run", slow_rank=3, compute_only=True))
    stats = rank_stats(run.ranks)
    assert len({round(s.median_step_s, 3) for s in stats}) <= 2  # step times alone hide it
    straggler = find_straggler(stats)
    assert straggler.slowest == 3 and straggler.metric == "local_time_s" and straggler.is_straggler
    assert "local work (data + compute)" in straggler.note


def test_balanced_ranks_and_single_rank(tmp_path):
    run = load_run(make_run(tmp_path / "a", slow_rank=None))
    straggler = find_straggler(rank_stats(run.ranks))
    assert not straggler.is_straggler and straggler.note.startswith("ranks are balanced")
    single = load_run(make_run(tmp_path / "b", num_ranks=1, slow_rank=None))
    assert find_straggler(rank_stats(single.ranks)) is None
    assert build_charts(single, None)[2].note == "one rank: nothing to compare"


def test_many_ranks_plot_slowest_fastest_and_median(tmp_path):
    run = load_run(make_run(tmp_path / "run", num_ranks=12, slow_rank=7, steps=12))
    ranks_chart = build_charts(run, find_straggler(rank_stats(run.ranks)))[2]
    labels = [series.label for series in ranks_chart.series]
    assert len(labels) == 3 and "rank 7" in labels and labels[-1] == "median of 12 ranks"


def test_malformed_lines_are_skipped_and_counted_and_resumed_steps_keep_the_last(tmp_path):
    run_dir = make_run(tmp_path / "run", steps=10)
    with (run_dir / "metrics.jsonl").open("a") as stream:
        stream.write("not json\n[1, 2]\n" + json.dumps({"kind": "train", "step": 10, "loss": 0.5}) + "\n")
        stream.write('{"kind": "train", "st')  # a crash mid-line
    (run_dir / "ranks" / "rank1.jsonl").open("a").write("garbage\n")
    run = load_run(run_dir / "metrics.jsonl")  # the file itself is accepted too
    assert run.skipped_lines == 4
    assert [r["step"] for r in run.train] == [2, 4, 6, 8, 10] and run.train[-1]["loss"] == 0.5
    report = write_report(run_dir, image_format="svg")
    assert report.skipped_lines == 4
    assert "4 (not JSON, or no step)" in report.html.read_text()


def test_no_rank_files_still_renders(tmp_path, no_matplotlib):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 5, "eval_loss": 2.0}) + "\n")
    report = write_report(run_dir)
    assert report.image_format == "svg" and report.straggler is None
    assert "No per-rank step times were logged" in report.html.read_text()


@pytest.mark.parametrize(("setup", "message"), [
    ("missing", "does not exist"),
    ("no_metrics", "metrics.jsonl not found"),
    ("empty", "is empty"),
    ("garbage", "no train or eval records (2 malformed lines skipped)"),
])  # fmt: skip
def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys, setup, message):
    run_dir = tmp_path / "runs" / "x"
    if setup != "missing":
        run_dir.mkdir(parents=True)
    if setup == "empty":
        (run_dir / "metrics.jsonl").write_text("\n")
    if setup == "garbage":
        (run_dir / "metrics.jsonl").write_text("{oops\n{\"loss\": 1}\n")
    code, out, err = cli([str(run_dir)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("meshrun report: error: ") and message in err
    assert "Traceback" not in err


def test_cli_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        report_cli.main([])
    assert exc.value.code == 2
    assert "RUN_DIR" in capsys.readouterr().err


def test_nice_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0, 97) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(1.23, 5.8) == [1, 2, 3, 4, 5, 6]
    ticks = nice_ticks(3.0, 3.0)
    assert ticks[0] <= 3.0 <= ticks[-1] and len(ticks) > 1


def test_failures_and_recoveries_are_marked_and_the_goodput_estimated(tmp_path):
    """Rank 0's rows as logged (steps 9-10 twice: redone after the restart) and events.jsonl as the
    workers write them: one agent restart after a failure past step 10, resumed at step 8."""
    run = tmp_path / "run"
    run.mkdir()
    times = [(s, 100.0 + s) for s in range(1, 11)] + [(s, 104.5 + s) for s in range(9, 21)]
    rows = [{"kind": "meta", "world_size": 2, "start_step": 0, "time": 100.0}]
    rows += [{"kind": "train", "step": s, "loss": 5.0 / s, "tokens_per_s": 100.0, "step_time_s": 1.0, "time": t}
             for s, t in times]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    events = [
        {"event": "worker_start", "rank": 0, "attempt": 0, "pid": 11, "time": 99.0},
        {"event": "resumed", "rank": 0, "attempt": 0, "pid": 11, "time": 100.0, "source": None, "step": 0},
        {"event": "first_step", "rank": 0, "attempt": 0, "pid": 11, "time": 101.0, "step": 1},
        {"event": "worker_start", "rank": 0, "attempt": 1, "pid": 22, "time": 111.2},
        {"event": "resumed", "rank": 1, "attempt": 1, "pid": 23, "time": 112.9, "source": "snapshot", "step": 8},
        {"event": "resumed", "rank": 0, "attempt": 1, "pid": 22, "time": 113.0, "source": "snapshot", "step": 8},
        {"event": "first_step", "rank": 0, "attempt": 1, "pid": 22, "time": 113.5, "step": 9},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"torn')
    data = load_run(run)
    [recovery] = data.recoveries
    assert (recovery.failed_after, recovery.resumed_at, recovery.source, recovery.redone) == (10, 8, "snapshot", 2)
    assert recovery.down_s == pytest.approx(3.5)  # last step before the failure at 110.0, next at 113.5
    assert data.goodput == pytest.approx(1 - (3.5 + 2 * 1.0) / (124.5 - 101.0))
    charts = {c.name: c for c in build_charts(data, None)}
    assert charts["loss"].failures == [10] and charts["throughput"].failures == [10]
    page = write_report(run, image_format="svg").html.read_text()
    assert "failed after step 10, resumed at step 8 from snapshot, 3.5 s to the next step, 2 steps redone" in page
    assert "goodput" in page and ">failed</text>" in (run / "loss.svg").read_text()
