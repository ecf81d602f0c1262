"""The live straggler verdict (metrics/stragglers.py `judge`) and the report's rows for it."""

from __future__ import annotations

import json

from meshrun.metrics.stragglers import MIN_GAP_S, judge
from meshrun.report.render import summary_rows
from meshrun.report.run import load_run


def test_a_rank_consistently_slower_than_the_others_median_is_named():
    [slow] = judge([0.008, 0.001, 0.001, 0.001], [0.004, 0.004, 0.0042, 0.0039])
    assert slow.rank == 0 and 2.3 < slow.ratio < 2.5 and abs(slow.data_share - 0.667) < 0.01
    assert slow.line().startswith("rank 0 is 2.4x slower than the median of the others")
    assert "its data wait is 67% of it" in slow.line()


def test_balanced_ranks_and_tiny_gaps_name_nobody():
    assert judge([0.001, 0.001], [0.010, 0.0115]) == []  # 1.14x: below the ratio
    tiny = MIN_GAP_S / 3
    assert judge([0.0, 0.0], [tiny, 3 * tiny]) == []  # 3x, but a gap nobody waits for
    assert judge([0.0, 0.0, 0.0], [0.0, 0.0, 0.0]) == []


def test_the_report_says_when_a_straggler_began_and_ended(tmp_path):
    rows = [{"kind": "meta", "world_size": 2, "time": 1.0},
            {"kind": "train", "step": 50, "loss": 2.0, "time": 2.0},
            {"kind": "meta", "event": "straggler", "step": 50, "rank": 1, "ratio": 1.4, "data_share": 0.8, "time": 2.0},
            {"kind": "meta", "event": "straggler_cleared", "step": 150, "rank": 1, "time": 3.0},
            {"kind": "meta", "event": "straggler", "step": 200, "rank": 1, "ratio": "x", "data_share": "bad", "time": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path)
    assert "rank" not in run.meta and run.meta["world_size"] == 2  # the rows are not run facts
    found = [value for label, value in summary_rows(run, [], None) if label == "straggler"]
    assert found == ["rank 1 from step 50: 1.4x the others' median own work, data wait 80% of it",
                     "rank 1 no longer from step 150", "rank 1 from step 200: xx the others' median own work"]
