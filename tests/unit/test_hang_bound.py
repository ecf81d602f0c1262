"""The hang watchdog's bound (debug/watchdog.py `hang_bound`) and what the heartbeat times for it
(debug/heartbeat.py): the step times outside announced phases, and the setup's length."""

from __future__ import annotations

import time

from meshrun.debug.heartbeat import SETUP_PHASE, Heartbeat
from meshrun.debug.watchdog import START_FLOOR_S, STEP_FLOOR_S, hang_bound


def _bound(**kw) -> float:
    args = {"explicit": False, "busy": 0, "step_times": [], "setup_s": None, "paced": True} | kw
    return hang_bound(300.0, **args)[0]


def test_the_bound_follows_the_step_time_within_the_floor_and_the_long_default():
    assert _bound(step_times=[0.2] * 50) == STEP_FLOOR_S  # 5 x 0.2 s is below the floor
    assert _bound(step_times=[3.0] * 49 + [4.0]) == 20.0  # 5 x the p99 (the slowest of 50)
    assert _bound(step_times=[100.0] * 10) == 300.0  # never above the long default
    assert _bound(step_times=[0.2, 0.2]) == 300.0  # too few steps: nothing known yet


def test_phases_an_explicit_timeout_and_an_unannounced_script_keep_the_long_bound():
    steps = [0.2] * 50
    assert _bound(step_times=steps, busy=1) == 300.0
    assert _bound(step_times=steps, explicit=True) == 300.0
    assert _bound(step_times=steps, paced=False) == 300.0
    assert "--hang-timeout" == hang_bound(300.0, explicit=True, busy=0, step_times=steps, setup_s=None)[1]


def test_before_the_first_steps_the_setup_bounds_it():
    assert _bound(setup_s=2.0) == START_FLOOR_S
    assert _bound(setup_s=20.0) == 100.0
    assert _bound(setup_s=200.0) == 300.0


def test_the_heartbeat_times_steps_outside_phases_only():
    beat = Heartbeat()
    assert not beat.paced
    with beat.phase(SETUP_PHASE):
        time.sleep(0.01)
    assert beat.paced and beat.setup_s is not None and beat.setup_s >= 0.01 and not beat.phases
    for _ in range(3):
        beat.step()
    assert len(beat.step_times) == 2  # the first step after a phase starts the clock
    with beat.phase("eval"):
        assert beat.phases == ["eval"]
        time.sleep(0.05)
        beat.step()  # a step inside a phase (a compiled first step) is not timed
    beat.step()
    assert len(beat.step_times) == 2 and max(beat.step_times) < 0.05  # the eval's time is no step's
    count = beat.count
    with beat.phase("checkpoint"):
        pass
    assert beat.count == count + 1  # a phase's end is progress
