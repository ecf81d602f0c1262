"""`meshrun report RUN_DIR [--out DIR] [--format auto|png|svg]`: a run's curves as images and one HTML page.

This module parses arguments and prints; the reading and drawing live in `meshrun.report`.
"""

from __future__ import annotations

import argparse
import sys

from meshrun.argparser import Parser

DESCRIPTION = """\
Render a run's metrics as charts and one HTML page:
  loss.png        train loss and eval loss vs step
  throughput.png  tokens/s vs step (median MFU when it was logged)
  lr.png          learning rate vs step
  grad_norm.png   gradient norm (before clipping) vs step
  ranks.png       each rank's step time vs step, with the slowest rank named
  report.html     the charts inline and a summary table; dashed lines mark where the run resumed

With traces from `meshrun train --profile STEPS` (RUN_DIR/profile/rank<N>.json) it also prints,
per rank, the share of the profiled time spent in collectives and the top operators by self CPU
time, and links the traces from report.html.

It reads RUN_DIR/metrics.jsonl (rank 0) and RUN_DIR/ranks/rank<N>.jsonl (every rank).
PNGs need matplotlib (pip install matplotlib); without it the charts are SVG.
"""

EPILOG = """\
examples:
  meshrun report runs/default                  # writes into runs/default/
  meshrun report runs/default --out /tmp/rep   # writes elsewhere
  meshrun report runs/default --format svg     # no matplotlib needed

exit status: 0 when the report was written, 2 when the run cannot be read or written.
"""


def build_parser(prog: str = "meshrun report") -> argparse.ArgumentParser:
    parser = Parser(
        prog=prog, description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="A run directory, e.g. runs/<name>.")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="Directory for the images and report.html (default: RUN_DIR itself).")
    parser.add_argument("--format", dest="image_format", choices=("auto", "png", "svg"), default="auto",
                        help="Chart images: png (needs matplotlib), svg, or auto = png when matplotlib "
                             "is installed, else svg (default: auto).")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from meshrun.report import write_report

    if args.out is not None:  # its images and report.html never land inside a checkpoint
        from meshrun.checkpoint.outputs import check_output

        check_output("--out", args.out, writes=[], force=True)

    report = write_report(args.run_dir, args.out, image_format=args.image_format)
    images = ", ".join(path.name for path in report.images)
    print(f"meshrun report: wrote {report.html} ({images})")
    if report.image_format == "svg" and args.image_format == "auto":
        print("meshrun report: matplotlib is not installed, so the charts are SVG "
              "(pip install matplotlib for PNGs)", file=sys.stderr)
    if report.straggler is not None:
        print(f"meshrun report: {report.straggler.note}")
    if report.profiles:
        from meshrun.report.profile import profile_lines

        for line in profile_lines(report.profiles):
            print(f"meshrun report: profile {line}")
    if report.skipped_lines:
        print(f"meshrun report: skipped {report.skipped_lines} malformed lines", file=sys.stderr)
    return 0
