"""How `run_distributed` starts its ranks: forked from a server that imported torch once.

A spawned rank paid `import torch` itself, about 2 s of CPU each, most of a short test's cost on
2 cores. The ranks instead fork from multiprocessing's forkserver with PRELOAD imported: one
server per process, started at the first run, single-threaded (it only imports; see
meshrun.launch.preload for why that is fork-safe). Each rank is a fresh fork of it, so nothing
leaks from one run to the next. A rank gets the environment a spawned one would (the parent's at
start(), plus its rank's variables): `worker.run_rank` puts it in place before anything else and
sets torch's intra-op threads from OMP_NUM_THREADS (the server's OpenMP read its own at import).
MESHRUN_TEST_START=spawn spawns each rank instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os

PRELOAD = ("torch", "torch.distributed", "meshrun.runtime.session")  # what every rank imports first
START_METHOD = "forkserver"


def context():
    """The start method's context; forkserver's with PRELOAD, unless MESHRUN_TEST_START=spawn."""
    method = os.environ.get("MESHRUN_TEST_START", START_METHOD)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts: the first run here
    return ctx


def parent_pid(ctx) -> int:
    """The pid a rank's parent has: this process (spawn), or the forkserver, started if need be.
    A rank exits when that parent does (PR_SET_PDEATHSIG), and the forkserver exits with this process."""
    if ctx.get_start_method() != "forkserver":
        return os.getpid()
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return forkserver._forkserver._forkserver_pid  # no public accessor; meshrun.launch.preload reads it too
