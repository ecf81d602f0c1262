"""The hang watchdog: when no rank makes progress for --hang-timeout seconds, fail with stacks.

Heartbeat is a returned collective (collectives.py), an optimizer step (a global step hook, so
any training loop counts), or an explicit `meshrun.heartbeat()`. A background thread, started
when the worker imports torch, reads the local counter once a second: the training loop itself
pays nothing beyond those increments. Each thread adds its rank's new progress to one store
counter; when that job-wide counter has not moved for the timeout, the first thread to see it
raises the alarm under a store key, every rank prints its stack and last collectives, writes
error.json and exits with HANG_EXIT_CODE, so the elastic agent fails (or restarts) the job
instead of waiting out torch's timeout.

When is it a hang? Once any rank has made progress, whenever the counter stands still for the
bound (`hang_bound`). With --hang-timeout given, the bound is that fixed value. By default it follows the
run's own pace: STEP_FACTOR x the p99 of the last steps' times, at least STEP_FLOOR_S (a rank
stopped mid-training is found in seconds, not in the 300 s default), once the code has announced
a phase (a plain script that never does keeps the long default: its eval would look like a hang); before the first steps,
START_FACTOR x how long the announced setup took, at least START_FLOOR_S; the long default while
any rank is in an announced phase (`meshrun.phase`: the trainer's eval, checkpoint saves,
compiled first steps, setup), or when nothing is known yet. Never more than the long default. Before that (start-up, loading) only when some rank has waited inside a collective for
the whole timeout: its peers are not coming, e.g. one rank stuck in user code before the job's
first collective. The rank that raised the alarm then names the ranks that are not in a
collective, from what each rank published (WHERE_KEY); a rank with no running watchdog (stuck
before importing torch) is asked for its stack with a signal when it runs on this host (stacks.py).
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time

from meshrun.debug.heartbeat import Heartbeat

HANG_EXIT_CODE = 124
ALARM_KEY = "hang/alarm"
DUMPED_KEY = "hang/dumped"
PROGRESS_KEY = "hang/progress"
WHERE_KEY = "hang/where/"  # + rank: {"state": "collective" | "torch" | "user", "where": "..."}
REPORTED_KEY = "hang/reported"  # the alarm rank has printed the job-wide report
LEFT_KEY = "hang/left"  # ranks that have finished (destroy_process_group, shutdown or exit)
STARTED_KEY = "hang/started"  # watchdogs that have connected to the store
STOPPED_KEY = "hang/stopped"  # watchdogs that have stopped using the store
BUSY_KEY = "hang/busy"  # announced phases running now, job-wide
DUMP_GRACE_S = 5.0  # how long the first rank waits for the others to print their stacks
# The default bound (docs/diagnose.md, "How long before a hang is called"): a healthy step's time
# varies by well under 2x (data, GC, a straggler); 5x the p99 of the last STEP_WINDOW steps leaves
# room for that, and the floor for steps too short to time (a tiny model's 0.1 s) and for noise
# from other jobs on the machine.
STEP_FACTOR, STEP_FLOOR_S, MIN_STEPS = 5.0, 10.0, 3
START_FACTOR, START_FLOOR_S = 5.0, 30.0  # the first steps, from the setup's length (they may build caches)


def hang_bound(long_s: float, *, explicit: bool, busy: int, step_times, setup_s: float | None,
               paced: bool = True) -> tuple[float, str]:
    """How long the job-wide progress may stand still before it is a hang, and why that long.
    `paced`: the code announces its slow phases (meshrun's trainer does); a script that never
    does keeps the long default, since its own eval or save would look like a hang."""
    if explicit:
        return long_s, "--hang-timeout"
    if not paced:
        return long_s, "the default; a script that announces its slow phases (meshrun.phase) gets a bound from its step time"
    if busy:
        return long_s, "the default, while a rank is in an announced phase (eval, checkpoint, compile)"
    times = sorted(step_times)
    if len(times) >= MIN_STEPS:
        p99 = times[math.ceil(0.99 * len(times)) - 1]
        bound = min(long_s, max(STEP_FLOOR_S, STEP_FACTOR * p99))
        return bound, f"{STEP_FACTOR:g} x the p99 step time {p99:.2f}s, at least {STEP_FLOOR_S:g}s; --hang-timeout fixes it"
    if setup_s is not None:
        bound = min(long_s, max(START_FLOOR_S, START_FACTOR * setup_s))
        return bound, f"{START_FACTOR:g} x the setup's {setup_s:.1f}s, at least {START_FLOOR_S:g}s; --hang-timeout fixes it"
    return long_s, "the default: no step timed yet"


class Watchdog(threading.Thread):
    def __init__(self, timeout_s: float, rank: int, world_size: int, store_factory, skip_dirs,
                 heartbeat: Heartbeat, explicit: bool = True) -> None:
        super().__init__(name="meshrun-hang-watchdog", daemon=True)
        self.heartbeat = heartbeat
        self.timeout_s = timeout_s  # the long bound (the fixed one when `explicit`)
        self.explicit = explicit  # --hang-timeout given: never follow the steps' pace
        self.bound_s, self.why = timeout_s, "--hang-timeout"  # the bound in force, for the report
        self.rank = rank
        self.world_size = world_size
        self.store_factory = store_factory
        self.skip_dirs = skip_dirs
        self.poll_s = min(1.0, timeout_s / 10)
        self.stopped = threading.Event()
        self.store = None  # the thread's connection, once made
        self.leaving = False  # stopped by leave(), which then tells the peers; else stopped alone
        self.counted = False  # this rank is in STOPPED_KEY: rank 0 waits for every rank's one count

    def leave(self) -> None:
        """This rank is done: stop, and have every peer's watchdog stop too (see `_leave`); bounded."""
        self.leaving = True
        self.stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=2 * self.poll_s + 2)
        if self.store is not None and not self.is_alive():
            self._leave(self.store)
        elif not self.counted:  # the thread never connected (a short script): leave through a connection of its own
            from meshrun.debug.store import listening

            try:
                store = self.store_factory() if listening() else None
            except Exception:  # noqa: BLE001 - the store went away: the job is ending anyway
                store = None
            if store is not None:
                self._leave(store)

    def run(self) -> None:
        from meshrun.debug.store import listening

        while not listening():  # started with torch's import: rank 0 may not serve the store yet
            if self.stopped.wait(self.poll_s):
                return
        store = self.store_factory()
        if store is None:
            return
        try:
            store.add(STARTED_KEY, 1)
        except Exception:  # noqa: BLE001
            return
        self.store = store
        published = published_busy = 0
        seen_total, changed_at = -1, time.monotonic()
        beat = self.heartbeat
        while not self.stopped.wait(self.poll_s):
            try:
                local = beat.count
                if local != published:
                    total = store.add(PROGRESS_KEY, local - published)
                    published = local
                else:
                    total = store.add(PROGRESS_KEY, 0)
                busy = 0
                if not self.explicit:
                    phases = len(beat.phases)
                    busy = store.add(BUSY_KEY, phases - published_busy)
                    published_busy = phases
                if store.check([ALARM_KEY]):
                    return self._fire(store, json.loads(store.get(ALARM_KEY)))
                if store.add(LEFT_KEY, 0) > 0:  # a peer finished: the job is ending, its store may go
                    self.heartbeat.job_ending.set()
                    self.store = None
                    store.add(STOPPED_KEY, 1)
                    self.counted = True
                    return
            except Exception:  # noqa: BLE001 - the store went away: the job is ending anyway
                self.store = None
                return
            now = time.monotonic()
            self.bound_s, self.why = hang_bound(self.timeout_s, explicit=self.explicit, busy=busy,
                                                step_times=beat.step_times, setup_s=beat.setup_s, paced=beat.paced)
            if total != seen_total:
                seen_total, changed_at = total, now
            elif now - changed_at >= self.bound_s and (total > 0 or self._waited_in_collective()):
                alarm = {"rank": self.rank, "time": time.time(), "idle_s": round(now - changed_at, 1)}
                try:  # the first rank to see it sets the alarm; everyone reports that one
                    alarm = json.loads(store.compare_set(ALARM_KEY, "", json.dumps(alarm)))
                except Exception:  # noqa: BLE001
                    pass
                return self._fire(store, alarm)
        if not self.leaving:  # stopped alone (a shorter timeout turned it off): rank 0 need not wait for it
            try:
                store.add(STOPPED_KEY, 1)
                self.counted = True
            except Exception:  # noqa: BLE001
                pass
            self.store = None

    def _leave(self, store) -> None:
        """Tell the peers' watchdogs; where this process serves the store, wait until they stopped.

        Rank 0 serves the job's store (unless the agent does): a peer still polling it after rank 0
        exits would meet a closed connection, and torch logs that with a C++ stack.
        """
        self.store = None
        try:
            store.add(LEFT_KEY, 1)
            store.add(STOPPED_KEY, 1)
            self.counted = True
            if self.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                return
            # Every rank counts once (its watchdog stopping, or leave() without one), so wait for the
            # world, not only for the watchdogs connected so far: one that connects late, after rank 0
            # exited, would meet a closed connection and torch would log a C++ stack.
            deadline = time.monotonic() + 2 * self.poll_s + 3
            while (store.add(STOPPED_KEY, 0) < max(store.add(STARTED_KEY, 0), self.world_size)
                   and time.monotonic() < deadline):
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store went away: the job is ending anyway
            pass

    def _waited_in_collective(self) -> bool:
        """This rank has been inside one collective for the whole timeout (its peers are not coming)."""
        inside = self.heartbeat.open_collective()
        return inside is not None and time.time() - inside.started >= self.timeout_s

    def _fire(self, store, alarm: dict) -> None:
        from meshrun.debug.stacks import dump_all_threads, main_thread_site

        self.heartbeat.hang_reported.set()
        site, in_torch = main_thread_site(self.skip_dirs)
        inside = self.heartbeat.open_collective()
        if inside is not None:
            state, where = "collective", f"waiting in {inside.op} #{inside.seq} at {inside.site} for a peer"
        elif in_torch:
            state, where = "torch", f"waiting inside torch (a collective or a kernel) called from {site}"
        else:
            state, where = "user", f"stalled in user code at {site}"
        head = (f"hang watchdog: no rank made progress for {self.bound_s:.3g}s ({self.why}); "
                f"rank {self.rank} is {where}")
        err = sys.stderr
        print(f"meshrun: {head}", file=err)
        print(f"meshrun: rank {self.rank}'s last collectives (oldest first):", file=err)
        for record in self.heartbeat.recent:
            print(f"    {record.describe()}", file=err)
        if not self.heartbeat.recent:
            print("    none seen from Python", file=err)
        _flight_recorder(err)
        print(f"meshrun: rank {self.rank}'s Python stacks, every thread:", file=err)
        dump_all_threads(err)
        err.flush()
        if alarm.get("rank") == self.rank:
            _write_error_file(head, site)  # at once: the report below may be cut short by the agent
            head = self._report_absent(store, state, where, head, err)
            _write_error_file(head, site)
        else:
            _write_error_file(head, site)
            self._answer(store, state, where)
        err.flush()
        sys.stdout.flush()
        os._exit(HANG_EXIT_CODE)


    def _answer(self, store, state: str, where: str) -> None:
        """Publish where this rank is; stay alive until the alarm rank has reported (bounded)."""
        try:
            store.set(f"{WHERE_KEY}{self.rank}", json.dumps({"state": state, "where": where}))
            store.add(DUMPED_KEY, 1)
            deadline = time.monotonic() + DUMP_GRACE_S + 2
            while not store.check([REPORTED_KEY]) and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store went away: the job is ending anyway
            pass

    def _report_absent(self, store, state: str, where: str, head: str, err) -> str:
        """Wait for every rank's answer; print (and return in `head`) the ranks not in a collective."""
        from meshrun.debug.stacks import signal_local_ranks

        states = {self.rank: {"state": state, "where": where}}
        try:
            store.add(DUMPED_KEY, 1)
            deadline = time.monotonic() + DUMP_GRACE_S
            while store.add(DUMPED_KEY, 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(0.1)
            for rank in range(self.world_size):
                if rank != self.rank and store.check([f"{WHERE_KEY}{rank}"]):
                    states[rank] = json.loads(store.get(f"{WHERE_KEY}{rank}"))
        except Exception:  # noqa: BLE001
            pass
        silent = [r for r in range(self.world_size) if r not in states]
        asked = signal_local_ranks(silent, err) if silent else []  # no watchdog there: faulthandler
        line = absent_ranks(states, silent, asked)
        if line:
            print(f"meshrun: {line}", file=err)
            head = f"{head}; {line}"
        try:
            store.set(REPORTED_KEY, "1")
            time.sleep(0.3)  # the store may live in this process: let the others see the key first
        except Exception:  # noqa: BLE001
            pass
        return head


def absent_ranks(states: dict[int, dict], silent: list[int], asked: list[int] = ()) -> str:
    """'not in a collective: rank 1 (stalled in user code at t.py:6 in load)', or '' when all are in one."""
    waiting = [r for r, s in states.items() if s.get("state") in ("collective", "torch")]
    outside = sorted(r for r, s in states.items() if s.get("state") == "user")
    parts = []
    if waiting and outside:
        parts.append("not in a collective: " + "; ".join(f"rank {r} ({states[r].get('where')})" for r in outside))
    if silent:
        where = ("its stack, asked for by signal, is in its output" if set(silent) <= set(asked)
                 else "on another host, or in C code holding the GIL: see its log")
        parts.append(f"not in a collective and not answering: rank {', '.join(map(str, silent))} "
                     f"(no watchdog there: stuck before importing torch?; {where})")
    return "; ".join(parts)


def _flight_recorder(err) -> None:
    """NCCL's flight recorder (best effort): the collectives in flight on every communicator."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return
        import pickle

        import torch

        trace = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
        entries = trace.get("entries", [])[-8:]
        print(f"meshrun: NCCL flight recorder, last {len(entries)} entries:", file=err)
        for entry in entries:
            print(f"    {entry.get('profiling_name')} seq={entry.get('collective_seq_id')} "
                  f"state={entry.get('state')} sizes={entry.get('input_sizes')}", file=err)
    except Exception as exc:  # noqa: BLE001
        print(f"meshrun: NCCL flight recorder unavailable ({type(exc).__name__}); set "
              "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 to enable it", file=err)


def _write_error_file(head: str, site: str) -> None:
    """error.json in the launch bootstrap's format, so the summary and diagnose read it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    location, _, function = site.rpartition(" in ")
    file, _, line = location.rpartition(":")
    now = time.time()
    data = {
        "message": {"message": f"HangDetected: {head}", "extraInfo": {"py_callstack": "", "timestamp": str(int(now))}},
        "meshrun": {"time": now, "type": "HangDetected", "text": head, "file": file, "line": line,
                    "function": function, "rank": os.environ.get("RANK")},
    }
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError:
        pass
