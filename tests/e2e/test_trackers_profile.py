"""`[metrics] trackers` and `--profile` end to end: one 2-process `meshrun train` with all four
trackers writing locally (no network, no mocks), a resumed session, then every tracker's files
read back with the tracker's own reader, the traces with json, and `meshrun report`'s summary."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import BIN, meshrun, requires, run_proc, train_tiny

pytestmark = requires("mlflow", "wandb", "trackio", "tensorboard")

STEPS = 4
RESUME = """
import sys
from meshrun.metrics import MetricsLogger
# a second session of the same run, as the trainer opens it after resuming from step 4
with MetricsLogger(sys.argv[1], rank=0, tensorboard=False, trackers=("mlflow", "wandb", "trackio"),
                   config={"train": {"steps": 6}}) as metrics:
    metrics.log_meta(world_size=2, start_step=4)
    for step in (5, 6):
        metrics.log_train(step, loss=1.0 / step, lr=1e-3, grad_norm=0.5)
    metrics.log_meta(event="end", tokens_per_s=123.0)
# read back here, where mlflow and trackio are imported already: each library's own reader
import json, os
from pathlib import Path
from mlflow.tracking import MlflowClient
from trackio.sqlite_storage import SQLiteStorage  # on the database meshrun pointed it at
run = Path(sys.argv[1])
os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
run_id = json.loads((run / "trackers.json").read_text())["mlflow_run_id"]
mlrun = client.get_run(run_id)
runs = SQLiteStorage.get_runs("meshrun")
print(json.dumps({"mlflow": {"steps": sorted(m.step for m in client.get_metric_history(run_id, "train/loss")),
                             "params": mlrun.data.params, "metrics": mlrun.data.metrics,
                             "tags": mlrun.data.tags, "status": mlrun.info.status},
                  "trackio": {"runs": runs, "logs": SQLiteStorage.get_logs("meshrun", runs[0]),
                              "config": SQLiteStorage.get_run_config("meshrun", runs[0])}}))
"""


def _env(tmp, monkeypatch):
    """No W&B login and no tracker settings: meshrun must choose local files and offline mode by
    itself; wandb's own config and cache stay in tmp."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME",
                 "TRACKIO_DIR", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(name, raising=False)  # the children get this process's environment
    return {"NETRC": str(tmp / "no-netrc"), "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
            "WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data")}


def test_four_trackers_and_profile_on_two_processes(tmp_path, monkeypatch):
    env = _env(tmp_path, monkeypatch)
    result, run = train_tiny(tmp_path, "tracked", "--set", f"train.steps={STEPS}", "--set", "train.eval_interval=0",
                             "--set", "metrics.interval=1", "--set", "checkpoint.interval=0",
                             "--set", "metrics.trackers=tensorboard,mlflow,wandb,trackio", "--profile", "2:3",
                             env=env, timeout=240)
    assert result.returncode == 0, result.output
    assert "Trackio" not in result.output  # trackio's banner is kept off the console
    resumed = run_proc([sys.executable, "-c", RESUME, str(run)], env=env, timeout=120)
    assert resumed.returncode == 0, resumed.output
    ids = json.loads((run / "trackers.json").read_text())

    # TensorBoard: the event files, through tensorboard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= set(events.Tags()["scalars"])

    # MLflow: the local file store, through MlflowClient; the resumed session continued the same run
    read = json.loads(resumed.stdout.strip().splitlines()[-1])
    mlrun = read["mlflow"]
    assert mlrun["steps"] == [1, 2, 3, 4, 5, 6] and mlrun["status"] == "FINISHED"
    assert mlrun["params"]["train.steps"] == str(STEPS) and mlrun["params"]["metrics.interval"] == "1"
    assert mlrun["metrics"]["summary/tokens_per_s"] == 123.0 and "summary.final_loss" in mlrun["tags"]

    # W&B: offline runs under the run directory (one per session, one id), read by wandb's reader
    offline = sorted((run / "wandb").glob(f"offline-run-*-{ids['wandb_id']}/run-{ids['wandb_id']}.wandb"))
    assert len(offline) == 2, list((run / "wandb").iterdir())
    inspect = run_proc([str(BIN / "wandb"), "leet", "inspect", "--summary", "--json", str(offline[0])], timeout=60)
    assert inspect.returncode == 0, inspect.output
    first = json.loads(inspect.stdout)
    assert first["config"]["train.steps"] == STEPS and first["state"] == "finished"
    assert first["summary"]["_step"] == STEPS and "final_loss" in first["summary"]
    assert first["summary"]["train/loss"] == pytest.approx(first["summary"]["final_loss"])

    # trackio: its SQLite database under the run directory, read back by trackio's storage API
    stored = read["trackio"]
    assert stored["runs"] == ["tracked"] and stored["config"]["train.steps"] == 6  # the latest session's
    assert sorted({row["step"] for row in stored["logs"] if "train/loss" in row}) == [1, 2, 3, 4, 5, 6]

    # --profile 2:3: one Chrome trace per rank, json-loadable, holding exactly the steps asked for
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank{rank}.json").read_text())
        steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
        assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])  # profile_memory on CPU
    report = meshrun("report", str(run), "--format", "svg", timeout=120)
    assert report.returncode == 0, report.output
    lines = [line for line in report.stdout.splitlines() if "profile rank" in line]
    assert len(lines) == 2 and all("steps 2-3" in line and "% in collectives" in line for line in lines)
    page = (run / "report.html").read_text()
    assert 'href="profile/rank1.json"' in page and "resumed" in page and "at step 4" in page
    assert os.path.isfile(run / "lr.svg") and os.path.isfile(run / "grad_norm.svg")
