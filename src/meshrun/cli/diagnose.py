"""`meshrun diagnose RUN_OR_LOG_DIR [--json]`: the post-mortem of a failed run from its logs.

    meshrun diagnose runs/my-run                 # a `meshrun train` run directory
    meshrun diagnose /tmp/meshrun-launch-abc     # a `meshrun launch --log-dir`
"""

from __future__ import annotations

import json

from meshrun.argparser import Parser
from meshrun.diagnose.postmortem import diagnose, format_diagnosis


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="meshrun diagnose", description=__doc__.split("\n\n")[0],
        epilog="Prints a timeline across ranks, the rank that failed first, the classification (OOM, "
               "collective mismatch, hang, rendezvous timeout, port conflict, exception in user code, "
               "killed by signal, data duplication warning) and the fix.")
    parser.add_argument("path", metavar="RUN_OR_LOG_DIR", help="a run directory (with logs/) or a launch --log-dir")
    parser.add_argument("--json", action="store_true", help="the same, as one JSON object")
    args = parser.parse_args(argv)
    diag = diagnose(args.path)
    if args.json:
        print(json.dumps(diag.to_json(), indent=1))
    else:
        print(format_diagnosis(diag))
    return 1 if diag.first is not None and diag.first.failed else 0
