"""`meshrun config show [CONFIG.toml] [--set section.key=value ...]`: the fully resolved config."""

from __future__ import annotations

import argparse

from meshrun.config import describe, load_config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshrun config",
        description="Print the fully resolved training config: every key, its value, its default "
                    "and its one-line doc. The output is valid TOML: save it and edit it.",
        epilog="example: meshrun config show examples/configs/tiny.toml --set optim.lr=3e-4 > my.toml",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved config")
    show.add_argument("config", nargs="?", help="TOML config file; omitted = the defaults")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    print(describe(load_config(args.config, args.overrides)))
    return 0
