"""`meshrun config show [CONFIG.toml] [--set section.key=value ...]`: the fully resolved config.

The `[parallel]` degrees are shown resolved (`meshrun.parallel.resolve`): with a fixed world size
in `[launch]` (a number of processes and of nodes) the ranks left are counted and the layout is
checked as `meshrun train` would, except against the model's heads and blocks (that needs torch:
`meshrun plan --show` does it); otherwise only the strategy's default is applied.
"""

from __future__ import annotations

import dataclasses

from meshrun.argparser import Parser
from meshrun.config import JobConfig, describe, load_config


def resolved(cfg: JobConfig) -> tuple[JobConfig, tuple[str, ...]]:
    """`cfg` with its parallel degrees resolved, and a note saying for which world size."""
    from meshrun.launch.args import fixed_world_size
    from meshrun.parallel.resolve import ParallelOptions, resolve_layout, stated_degrees

    options = ParallelOptions.from_config(cfg)
    launch = cfg.launch
    world = fixed_world_size(launch.nproc_per_node, launch.nnodes)
    if world is None:
        degrees = stated_degrees(options)
        note = (f"[parallel] the world size is known only at launch (launch.nproc_per_node = "
                f"{launch.nproc_per_node!r}, launch.nnodes = {launch.nnodes!r}): -1 = the ranks left then")
    else:  # no model shape: it needs torch (seconds); `meshrun train` and `meshrun plan` check it
        layout = resolve_layout(options, world)
        degrees = layout.dims.degrees
        note = (f"[parallel] resolved for world size {world} (launch.nproc_per_node = "
                f"{launch.nproc_per_node} x launch.nnodes = {launch.nnodes}): {layout.describe()}")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **degrees)), (note,)


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="meshrun config",
        description="Print the fully resolved training config: every key, its value, its default "
                    "and its one-line doc, the parallel degrees resolved for the [launch] world "
                    "size when it is fixed. The output is valid TOML: save it and edit it.",
        epilog="example: meshrun config show examples/configs/tiny.toml --set optim.lr=3e-4 > my.toml",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved config")
    show.add_argument("config", nargs="?", help="TOML config file; omitted = the defaults")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    cfg, notes = resolved(load_config(args.config, args.overrides))
    print(describe(cfg, notes))
    return 0
