"""[metrics] trackers, the tracker failure policy, --profile's step range and profiler, and what
`meshrun report` makes of traces and resumes; in one process (the real libraries run end to end
in tests/e2e/test_trackers_profile.py)."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from conftest import run_proc

from meshrun.cli.train import check_train_args
from meshrun.config import load_config, to_toml
from meshrun.config.loader import config_from_dict
from meshrun.errors import ConfigError
from meshrun.metrics import MetricsLogger
from meshrun.metrics.tracker_adapters import wandb_logged_in
from meshrun.metrics.tracker_base import flat_config
from meshrun.metrics.trackers import TrackerSet
from meshrun.report import load_run, write_report
from meshrun.report import profile as report_profile
from meshrun.report.render import build_charts, summary_rows
from meshrun.train.profile import StepProfiler, StepRange, parse_steps

# --- config ---------------------------------------------------------------------------------


def test_trackers_take_a_toml_array_or_a_comma_list_and_round_trip(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[metrics]\ntrackers = ["mlflow", "wandb"]\n')
    cfg = load_config(path)
    assert cfg.metrics.tracker_names == ("mlflow", "wandb")
    assert load_config(None, ["metrics.trackers=trackio, tensorboard"]).metrics.tracker_names == ("trackio", "tensorboard")
    assert load_config(None).metrics.tracker_names == ()  # default: none (tensorboard = true stays best effort)
    saved = tmp_path / "saved.toml"
    saved.write_text(to_toml(cfg))
    assert load_config(saved) == cfg


@pytest.mark.parametrize(("trackers", "message"), [
    (["mlflow", "neptune"], "metrics.trackers: unknown tracker 'neptune'; choose from 'tensorboard', 'mlflow'"),
    ("wandb,wandb", "metrics.trackers names a tracker twice"),
    ([1, 2], "metrics.trackers must be an array of strings (or one comma-separated string), got an array"),
])  # fmt: skip
def test_bad_trackers_are_one_line(trackers, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"metrics": {"trackers": trackers}})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


BLOCKED = """
import sys
class Block:  # as if meshrun[mlflow] were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "mlflow" or name.startswith("mlflow."):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
from meshrun.cli import main
sys.exit(main(["train", "--set", "metrics.trackers=tensorboard,mlflow", "--set", "train.run_dir=" + sys.argv[1]]))
"""


def test_a_missing_tracker_library_is_one_line_naming_the_extra_before_any_worker(tmp_path):
    result = run_proc([sys.executable, "-c", BLOCKED, str(tmp_path / "runs")], timeout=60)
    assert result.returncode == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "metrics.trackers naming 'mlflow' needs mlflow" in lines[0]
    assert "pip install 'meshrun[mlflow]'" in lines[0]
    assert not (tmp_path / "runs").exists()  # refused before anything was created


# --- the failure policy and the W&B mode ----------------------------------------------------


class Flaky:
    """A tracker (meshrun's own protocol, not a library) that fails on its second log call."""

    def __init__(self, name):
        self.name, self.calls = name, []

    def log(self, values, step):
        self.calls.append(("log", step))
        if self.name == "flaky" and step == 2:
            raise RuntimeError("disk on fire")

    def summary(self, values, step):
        self.calls.append(("summary", dict(values)))

    def flush(self):
        pass

    def close(self):
        self.calls.append(("close",))


def test_a_failing_tracker_is_one_warning_then_off_and_the_others_go_on(caplog):
    flaky, steady = Flaky("flaky"), Flaky("steady")
    trackers = TrackerSet([flaky, steady])
    with caplog.at_level(logging.WARNING, logger="meshrun.metrics"):
        for step in (1, 2, 3):
            trackers.log("train", step, {"loss": 1.0, "peak_mem_kind": "rss", "ok": True})
        trackers.summary({"final_loss": 0.5}, 3)
        trackers.close()
    assert [r.getMessage() for r in caplog.records] == [
        "meshrun: tracker flaky failed in log() (RuntimeError: disk on fire); it is off for the rest of "
        "this run (metrics.jsonl has every row)"]
    assert flaky.calls == [("log", 1), ("log", 2), ("close",)]
    assert steady.calls == [("log", 1), ("log", 2), ("log", 3), ("summary", {"final_loss": 0.5}), ("close",)]


def test_a_tracker_that_cannot_start_leaves_training_and_jsonl_alone(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    (tmp_path / "tb").write_text("a file where TensorBoard wants its directory")
    with caplog.at_level(logging.WARNING, logger="meshrun.metrics"):
        with MetricsLogger(tmp_path, rank=0, tensorboard=False, trackers=("tensorboard",)) as metrics:
            metrics.log_train(1, loss=2.0)
    assert len(caplog.records) == 1 and "tracker tensorboard could not start" in caplog.records[0].getMessage()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.0


def test_wandb_is_offline_unless_a_key_or_netrc_login_exists(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not wandb_logged_in()
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    (tmp_path / "netrc").chmod(0o600)
    assert wandb_logged_in()
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert wandb_logged_in()


def test_flat_config_names_keys_by_section():
    assert flat_config({"train": {"steps": 3}, "metrics": {"trackers": "mlflow"}}) == {
        "train.steps": 3, "metrics.trackers": "mlflow"}


# --- --profile ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [("10:12", StepRange(10, 12)), ("5", StepRange(5, 5)),
                                                (" 2 : 3 ", StepRange(2, 3))])
def test_profile_steps_parse(text, expected):
    assert parse_steps(text, 20) == expected


@pytest.mark.parametrize(("argv", "message"), [
    (["--profile", "3:2"], "--profile 3:2: steps must satisfy 1 <= FIRST <= LAST <= train.steps (20)"),
    (["--profile", "0"], "--profile 0: steps must satisfy"),
    (["--profile", "19:21"], "--profile 19:21: steps must satisfy"),
    (["--profile", "a-b"], "--profile 'a-b': give STEP or FIRST:LAST"),
])  # fmt: skip
def test_bad_profile_flags_are_refused_before_launch(argv, message):
    with pytest.raises(ConfigError) as info:
        check_train_args(["examples/configs/tiny.toml", *argv])
    assert str(info.value).startswith(message)


def test_step_profiler_writes_a_trace_of_exactly_the_asked_steps(tmp_path):
    import torch

    profiler = StepProfiler(StepRange(2, 3), tmp_path, rank=0)
    x = torch.ones(8, 8)
    for step in range(1, 6):
        profiler.at(step)
        x = (x @ x).tanh()
    profiler.close()
    trace = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    steps = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    last = StepProfiler(StepRange(3, 3), tmp_path / "end", rank=1)  # the run's last step, ended by close()
    for step in (1, 2, 3):
        last.at(step)
    last.close()
    assert json.loads((tmp_path / "end" / "profile" / "rank1.json").read_text())["traceEvents"]


# --- meshrun report: traces and resumes -----------------------------------------------------


def _event(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_trace_summary_self_times_and_collective_share(tmp_path, monkeypatch):
    events = [_event("ProfilerStep#4", 0, 100, cat="user_annotation"),
              _event("aten::linear", 0, 40), _event("aten::mm", 5, 30),  # linear's self time: 10
              _event("c10d::allreduce_", 50, 20), _event("gloo:all_reduce", 60, 30, tid=2),  # 50..90: 40
              _event("aten::mm", 95, 10)]  # partly after the step
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "profile" / "rank1.json").write_text("{not json")
    ranks = report_profile.read_profiles(tmp_path)
    assert [p.rank for p in ranks] == [0, 1] and ranks[1].error
    rank0 = ranks[0]
    assert rank0.steps == [4] and rank0.step_time_us == 100 and rank0.collective_share == pytest.approx(0.4)
    assert dict((n, us) for n, us, _ in rank0.top_ops) == {
        "aten::mm": 40, "gloo:all_reduce": 30, "c10d::allreduce_": 20, "aten::linear": 10}
    lines = report_profile.profile_lines(ranks)
    assert lines[0].startswith("rank 0: step 4, 0.10 ms profiled, 40.0% in collectives; top self CPU: aten::mm")
    assert lines[1].startswith("rank 1: ") and "unreadable" in lines[1]
    monkeypatch.setattr(report_profile, "MAX_TRACE_BYTES", 10)
    assert "over the" in report_profile.read_profile(tmp_path / "profile" / "rank0.json", 0).error


def test_report_marks_where_the_run_resumed(tmp_path):
    for start, steps in ((0, range(1, 7)), (4, range(5, 9))):  # crashed after step 6, resumed from 4
        with MetricsLogger(tmp_path, rank=0, tensorboard=False) as metrics:
            metrics.log_meta(world_size=1, start_step=start)
            for step in steps:
                metrics.log_train(step, loss=1.0 / step, lr=1e-3 * step, grad_norm=2.0)
    run = load_run(tmp_path)
    assert run.resumed_at == [4]
    assert {chart.name: chart.marks for chart in build_charts(run, None)} == {
        "loss": [4], "throughput": [], "ranks": [], "lr": [4], "grad_norm": [4]}  # no data, no mark
    rows = dict(summary_rows(run, [], None))
    assert rows["resumed"] == "at step 4" and "start_step" not in rows
    report = write_report(tmp_path, image_format="svg")
    assert [p.name for p in report.images] == ["loss.svg", "throughput.svg", "ranks.svg", "lr.svg", "grad_norm.svg"]
    assert ">resumed</text>" in (tmp_path / "lr.svg").read_text()
    assert "No gradient" not in report.html.read_text() and report.profiles == []
