"""`run_distributed`: run a function on N real gloo processes and report the first failing rank.

The parent never blocks without a deadline: it waits on every rank's result pipe and process
sentinel together (`multiprocessing.connection.wait`), and a `finally` stops every child it
started, by pid (SIGTERM, then SIGKILL after a short grace).

How ranks start: forked from a server that imported torch once. A spawned rank paid `import torch`
itself, about 2 s of CPU each, most of a short test's cost on 2 cores. The ranks instead fork from
multiprocessing's forkserver with PRELOAD imported: one server per process, started at the first
run, single-threaded (it only imports; see meshrun.launch.preload for why that is fork-safe). Each
rank is a fresh fork of it, so nothing leaks from one run to the next. A rank gets the environment a
spawned one would (the parent's at start(), plus its rank's variables): `worker.run_rank` puts it in
place before anything else and sets torch's intra-op threads from OMP_NUM_THREADS (the server's
OpenMP read its own at import). MESHRUN_TEST_START=spawn spawns each rank instead.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from meshrun.testing.errors import NotPicklableError
from meshrun.testing.ports import pick_port
from meshrun.testing.report import (
    Failure,
    Unfinished,
    error_failure,
    exit_failure,
    first_failure,
    timeout_error,
)
from meshrun.testing.worker import run_rank

# What ranks import before their first step, imported once by the server instead of by every rank:
# torch, then DTensor, FSDP, pipelining and DCP (1.2 s of CPU a rank) and meshrun's layout and step
# code. None of these imports starts a thread.
PRELOAD = ("torch", "torch.distributed", "meshrun.runtime.session", "torch.distributed.tensor",
           "torch.distributed.tensor.parallel", "torch.distributed.fsdp", "torch.distributed.pipelining",
           "torch.distributed.checkpoint.state_dict", "meshrun.parallel.parallelize", "meshrun.train.step")
START_METHOD = "forkserver"


def _context():
    """The start method's context; forkserver's with PRELOAD, unless MESHRUN_TEST_START=spawn."""
    method = os.environ.get("MESHRUN_TEST_START", START_METHOD)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts: the first run here
    return ctx


def _parent_pid(ctx) -> int:
    """The pid a rank's parent has: this process (spawn), or the forkserver, started if need be.
    A rank exits when that parent does (PR_SET_PDEATHSIG), and the forkserver exits with this process."""
    if ctx.get_start_method() != "forkserver":
        return os.getpid()
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return forkserver._forkserver._forkserver_pid  # no public accessor; meshrun.launch.preload reads it too


# After the first failure, how long the other ranks get to fail or finish on their own (their
# errors are listed, not reported as the cause) before they are killed.
FOLLOW_ON_GRACE_S = 3.0
# How long a child gets to exit after SIGTERM before SIGKILL.
TERM_GRACE_S = 2.0

# The variables run_distributed sets for each rank; `env=` may not override them.
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class _Rank:
    rank: int
    proc: BaseProcess
    conn: Connection | None
    stack_path: str
    armed: bool = False  # its stacks can be dumped
    running: bool = False  # inside fn
    result: bytes | None = None
    returned: bool = False
    exitcode: int | None = None
    failure: Failure | None = None

    def state(self) -> str:
        if self.returned:
            return "fn returned; stuck in shutdown or exit"
        if self.running:
            return "running fn"
        if self.armed:
            return "starting (importing fn's module, or in meshrun.init)"
        return "starting (spawning the process, importing)"


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int = 2,
    timeout: float = 60.0,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    backend: str | None = "gloo",
    env: Mapping[str, str] | None = None,
    init: bool = True,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on `world_size` spawned processes; return each rank's value.

    Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free
    MASTER_PORT (in MESHRUN_TEST_PORTS=LO-HI when set, see meshrun.testing.ports) and
    OMP_NUM_THREADS=1 (as torchrun sets them), plus `env`. With `init` (the
    default) the rank joins the group with ``meshrun.init(backend=backend)`` before fn and leaves
    it with ``meshrun.shutdown()`` after (``backend=None`` lets meshrun choose: NCCL on GPUs);
    with ``init=False`` fn sets up (and destroys) its own group.

    fn must be a module-level function, and fn, args, kwargs and the return values picklable.
    timeout: seconds for the whole run, process start included.
    Returns the return values indexed by rank. Raises DistributedTestError for the first rank
    (by time) that raised, RankExitedError for a rank that died without raising, and
    DistributedTimeoutError (a TimeoutError) naming the unfinished ranks and their stacks.

    Example::

        def check_all_reduce() -> float:
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()

        def test_all_reduce():
            assert run_distributed(check_all_reduce, world_size=4) == [4.0] * 4
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    payload = _pickle_call(fn, args, kwargs)
    child_env = _child_env(world_size, env)
    ctx = _context()
    tmp_dir = tempfile.mkdtemp(prefix="meshrun-testing-")
    deadline = time.monotonic() + timeout
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            stack_path = os.path.join(tmp_dir, f"rank{rank}.stack")
            mine = {**child_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            # The rank's whole environment, as spawn would copy it at start(): a forked rank applies it.
            environ = {k: v for k, v in {**os.environ, **mine}.items() if v is not None}
            proc = ctx.Process(
                target=run_rank,
                args=(rank, payload, writer, init, backend, stack_path, _parent_pid(ctx), environ),
                name=f"meshrun-rank{rank}",
            )
            ranks.append(_Rank(rank, proc, reader, stack_path))
            # Spawn copies os.environ at start(), and so does the forkserver when this start
            # launches it: OMP_NUM_THREADS is in place before either imports torch.
            with _patched_environ(mine):
                proc.start()
            writer.close()  # only the child holds the write end, so its exit reads as EOF
        return _collect(ranks, deadline, timeout)
    finally:
        _stop(ranks)
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _pickle_call(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> bytes:
    if not callable(fn):
        raise TypeError(f"run_distributed: fn must be callable, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        kind = "a lambda" if "<lambda>" in qualname else "a local function"
        raise NotPicklableError(
            f"run_distributed: fn={qualname} is {kind}; spawned ranks import fn by name, "
            f"so define it with `def` at module level (pass its inputs with args=/kwargs=)"
        )
    try:
        return pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise NotPicklableError(
            f"run_distributed: fn, args and kwargs must be picklable to reach spawned ranks: "
            f"{type(exc).__name__}: {exc}; use a module-level function and plain data"
        ) from exc


def _child_env(world_size: int, env: Mapping[str, str] | None) -> dict[str, str | None]:
    env = dict(env or {})
    clash = sorted(set(env) & set(_RANK_VARS))
    if clash:
        raise ValueError(
            f"run_distributed: env may not set {', '.join(clash)}; it sets them per rank"
        )
    # A stale torchelastic environment (tests run under torchrun) would send env:// to its store.
    stale: dict[str, str | None] = {k: None for k in os.environ if k.startswith("TORCHELASTIC_")}
    return {
        **stale,
        "OMP_NUM_THREADS": "1",
        **env,
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(pick_port("127.0.0.1")),
    }


@contextlib.contextmanager
def _patched_environ(updates: Mapping[str, str | None]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in updates}
    try:
        _apply_environ(updates)
        yield
    finally:
        _apply_environ(saved)


def _apply_environ(values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _collect(ranks: list[_Rank], deadline: float, timeout: float) -> list[Any]:
    """Read messages and exits until every rank is done, one fails, or the deadline passes."""
    settle_by: float | None = None  # set by the first failure
    while any(r.exitcode is None for r in ranks):
        now = time.monotonic()
        limit = deadline if settle_by is None else min(deadline, settle_by)
        if now >= limit:
            break
        waitables: list[Any] = [r.conn for r in ranks if r.conn is not None]
        waitables += [r.proc.sentinel for r in ranks if r.exitcode is None]
        ready = set(wait(waitables, limit - now))
        for r in ranks:
            if r.conn is not None and r.conn in ready:
                _read_one(r)
            if r.exitcode is None and r.proc.sentinel in ready:
                _on_exit(r)
        if settle_by is None and any(r.failure for r in ranks):
            settle_by = time.monotonic() + FOLLOW_ON_GRACE_S
    failures = [r.failure for r in ranks if r.failure is not None]
    if failures:
        raise first_failure(failures)
    unfinished = [
        Unfinished(r.rank, r.state(), r.proc.pid, r.stack_path if r.armed else None)
        for r in ranks
        if r.exitcode is None
    ]
    if unfinished:
        raise timeout_error(unfinished, timeout)
    results = []
    for r in ranks:
        assert r.result is not None, "a rank that exited 0 without a result is a failure"
        results.append(pickle.loads(r.result))
    return results


def _read_one(r: _Rank) -> None:
    assert r.conn is not None
    try:
        message = r.conn.recv()
    except (EOFError, OSError):
        r.conn.close()
        r.conn = None
        return
    kind = message[0]
    if kind == "armed":
        r.armed = True
    elif kind == "running":
        r.running = True
    elif kind == "result":
        r.returned, r.result = True, message[1]
    elif kind == "error" and r.failure is None:
        r.failure = error_failure(r.rank, message[1])


def _on_exit(r: _Rank) -> None:
    while r.conn is not None and r.conn.poll(0):  # messages sent just before exit
        _read_one(r)
    r.proc.join(1.0)  # the sentinel closes a moment before the process can be reaped
    if r.proc.exitcode is None:
        return  # not reaped yet: its sentinel stays ready, so the next round comes back here
    r.exitcode = r.proc.exitcode
    if r.failure is None and not (r.exitcode == 0 and r.returned):
        r.failure = exit_failure(r.rank, r.exitcode, returned=r.returned)


def _stop(ranks: list[_Rank]) -> None:
    """SIGTERM every live child, SIGKILL what is left after TERM_GRACE_S, and reap them all."""
    alive = [r for r in ranks if r.proc.pid is not None and r.proc.is_alive()]
    for r in alive:
        r.proc.terminate()
    grace_end = time.monotonic() + TERM_GRACE_S
    for r in alive:
        r.proc.join(max(0.0, grace_end - time.monotonic()))
    for r in alive:
        if r.proc.is_alive():
            r.proc.kill()
            r.proc.join(5.0)
    for r in ranks:
        if r.conn is not None:
            r.conn.close()
            r.conn = None
