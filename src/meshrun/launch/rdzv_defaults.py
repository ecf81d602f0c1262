"""Rendezvous timings meshrun uses for several nodes over c10d, where `--rdzv-conf` left them out.

torch's c10d rendezvous drops a node after `keep_alive_interval` x `keep_alive_max_attempt`
seconds without a heartbeat (5 s x 3) and, once the minimum of nodes is in, waits
`last_call_timeout` (30 s) for more: a survivor of a lost host (`--nnodes 1:2`) resumed 44 s
after the loss with those values. meshrun's defaults detect the loss in a few seconds; the
heartbeat is a thread of each node's agent, so under load a few missed beats are tolerated
(measured with benchmarks/host_loss_detection.py, docs/multinode.md). Standard library only.
"""

from __future__ import annotations

# key -> seconds (or a count): what meshrun passes to torch when the user set none of them
MULTINODE_RDZV_DEFAULTS = {"keep_alive_interval": "1", "keep_alive_max_attempt": "5", "last_call_timeout": "2"}


def with_rdzv_defaults(rdzv_conf: str | None, *, backend: str, max_nodes: int) -> str:
    """`rdzv_conf` plus each default key it does not name (c10d across several nodes only)."""
    conf = rdzv_conf or ""
    if backend != "c10d" or max_nodes <= 1:
        return conf
    named = {item.split("=", 1)[0].strip() for item in conf.split(",") if "=" in item}
    extra = [f"{key}={value}" for key, value in MULTINODE_RDZV_DEFAULTS.items() if key not in named]
    return ",".join(filter(None, [conf, *extra]))
