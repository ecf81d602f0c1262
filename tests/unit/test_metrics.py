"""meshrun.metrics: the jsonl sink, peak memory / peak FLOPs / MFU, the step timer, the progress bar."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
import types

import pytest
import torch

from meshrun.metrics import (
    MetricsLogger,
    ProgressBar,
    StepTimer,
    device_peak_flops,
    mfu,
    peak_flops_for_name,
    peak_memory_bytes,
    peak_memory_kind,
    rank_file,
    transformer_flops_per_token,
)
from meshrun.metrics import logger as logger_module
from meshrun.metrics.progress import format_duration, format_rate


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- MetricsLogger ---------------------------------------------------------------------------


def test_rank0_writes_train_eval_and_rank_lines_flushed_before_close(tmp_path):
    run = tmp_path / "runs" / "demo"
    metrics = MetricsLogger(run, rank=0, tensorboard=False)
    metrics.log_train(10, loss=2.5, lr=3e-4, grad_norm=torch.tensor(1.5), tokens_per_s=1000.0,
                      step_time_s=0.2, peak_mem_bytes=123, peak_mem_kind="rss", mfu=None)
    metrics.log_eval(10, eval_loss=2.75)
    metrics.log_rank_step(10, step_time_s=0.2, data_time_s=0.01)
    # Not closed yet: a crash now must still leave these lines on disk.
    train, evaluation = read_jsonl(run / "metrics.jsonl")
    assert train["kind"] == "train" and train["step"] == 10 and train["loss"] == 2.5
    assert train["grad_norm"] == 1.5 and train["peak_mem_kind"] == "rss" and "mfu" not in train
    assert evaluation == {"kind": "eval", "step": 10, "time": evaluation["time"], "eval_loss": 2.75}
    assert read_jsonl(rank_file(run, 0)) == [{"step": 10, "step_time_s": 0.2, "data_time_s": 0.01}]
    metrics.close()
    metrics.close()  # twice is fine


def test_other_ranks_write_only_their_step_times(tmp_path):
    with MetricsLogger(tmp_path, rank=3, tensorboard=False) as metrics:
        metrics.log_train(1, loss=1.0)
        metrics.log_eval(1, eval_loss=1.0)
        metrics.log_rank_step(1, step_time_s=0.5)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert read_jsonl(tmp_path / "ranks" / "rank3.jsonl") == [{"step": 1, "step_time_s": 0.5}]


def test_non_finite_values_become_null_and_reserved_names_are_refused(tmp_path):
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as metrics:
        metrics.log_train(1, loss=float("nan"), grad_norm=math.inf)
        with pytest.raises(ValueError, match="reserved"):
            metrics.log_train(2, loss=1.0, kind="x")
    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert record["loss"] is None and record["grad_norm"] is None
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()  # strict JSON


def test_disabled_jsonl_writes_nothing_and_closed_logger_ignores_calls(tmp_path):
    with MetricsLogger(tmp_path / "run", rank=0, enabled_jsonl=False, tensorboard=False) as metrics:
        metrics.log_train(1, loss=1.0)
        metrics.log_rank_step(1, step_time_s=0.1)
    assert not (tmp_path / "run").exists()
    metrics = MetricsLogger(tmp_path / "run2", rank=0, tensorboard=False)
    metrics.close()
    metrics.log_train(1, loss=1.0)
    assert (tmp_path / "run2" / "metrics.jsonl").read_text() == ""


def test_reopening_after_a_torn_last_line_starts_a_fresh_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 3.0}\n{"kind": "tr')
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as metrics:
        metrics.log_train(2, loss=2.0)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == '{"kind": "tr' and json.loads(lines[2])["step"] == 2


def test_missing_tensorboard_is_one_info_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(logger_module.importlib.util, "find_spec", lambda name: None)
    with caplog.at_level(logging.DEBUG, logger="meshrun.metrics"):
        with MetricsLogger(tmp_path, rank=0, tensorboard=True) as metrics:
            for step in range(5):
                metrics.log_train(step, loss=1.0)
        MetricsLogger(tmp_path, rank=1, tensorboard=True).close()  # other ranks never ask
        MetricsLogger(tmp_path, rank=0, tensorboard=False).close()
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "pip install tensorboard" in caplog.records[0].getMessage()


def test_tensorboard_gets_numeric_scalars_when_installed(tmp_path, monkeypatch):
    calls = []

    class FakeWriter:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    monkeypatch.setattr(logger_module.importlib.util, "find_spec", lambda name: object())
    with MetricsLogger(tmp_path, rank=0) as metrics:
        metrics.log_train(3, loss=2.0, lr=0.1, peak_mem_kind="rss")
        metrics.log_eval(3, eval_loss=2.5)
    assert calls == [("init", str(tmp_path / "tb")), ("train/loss", 2.0, 3), ("train/lr", 0.1, 3),
                     ("eval/loss", 2.5, 3), ("close",)]


# --- system: memory, peak FLOPs, MFU, StepTimer ---------------------------------------------


def test_cpu_peak_memory_is_the_process_rss():
    assert peak_memory_bytes("cpu") > 10 * 2**20  # torch alone is far above 10 MiB
    assert peak_memory_kind("cpu") == "rss"
    assert peak_memory_kind(torch.device("cuda", 0)) == "cuda_max_allocated"


def test_peak_flops_unknown_on_cpu_so_mfu_is_none():
    assert device_peak_flops("cpu", torch.bfloat16) is None
    assert mfu(6e9, 1e4, device_peak_flops("cpu", torch.float32)) is None


@pytest.mark.parametrize(("name", "dtype", "tflops"), [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 NVL", torch.bfloat16, 835.5),
    ("NVIDIA H200", torch.bfloat16, 989.0),
    ("NVIDIA H20", torch.bfloat16, 148.0),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
    ("NVIDIA A10G", torch.bfloat16, 70.0),
    ("NVIDIA A10", "bfloat16", 125.0),
    ("NVIDIA L40S", torch.bfloat16, 362.0),
    ("NVIDIA L4", torch.bfloat16, 121.0),
    ("NVIDIA GeForce RTX 4090", torch.float32, 82.6),
    ("Tesla V100-SXM2-32GB", torch.float16, 125.0),
    ("Tesla V100-PCIE-16GB", torch.float32, 14.0),
    ("Tesla V100-SXM2-32GB", torch.bfloat16, None),  # no native bf16
    ("NVIDIA GeForce GTX 1080", torch.bfloat16, None),  # not in the table
    ("NVIDIA H100 80GB HBM3", torch.int8, None),
])  # fmt: skip
def test_peak_flops_table_matches_the_most_specific_name(name, dtype, tflops):
    peak = peak_flops_for_name(name, dtype)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_fp32_peak_uses_tf32_rate_when_allowed_and_fp32_before_ampere():
    assert peak_flops_for_name("NVIDIA A100-SXM4-40GB", torch.float32) == pytest.approx(19.5e12)
    assert peak_flops_for_name("NVIDIA A100-SXM4-40GB", torch.float32, tf32=True) == pytest.approx(156e12)
    assert peak_flops_for_name("Tesla V100-SXM2-16GB", torch.float32, tf32=True) == pytest.approx(15.7e12)


def test_mfu_and_flops_per_token():
    assert mfu(1e9, 1e5, 2e14) == pytest.approx(0.5)
    assert mfu(None, 1e5, 2e14) is None and mfu(1e9, 1e5, None) is None and mfu(1e9, 0.0, 1e12) is None
    assert transformer_flops_per_token(1000, num_layers=2, dim=8, seq_len=4) == 6 * 1000 + 12 * 2 * 8 * 4


def test_step_timer_leaves_warmup_out_of_averages():
    clock = FakeClock()
    timer = StepTimer(warmup_steps=2, clock=clock)
    for duration in (5.0, 3.0, 1.0, 1.0, 2.0):  # two slow warm-up steps
        timer.start()
        clock.now += 0.25
        timer.data_done()
        clock.now += duration - 0.25
        timing = timer.stop(num_tokens=100)
    assert timing.step_time_s == pytest.approx(2.0) and timing.tokens_per_s == pytest.approx(50.0)
    assert timing.data_time_s == pytest.approx(0.25)
    assert timer.num_steps == 5
    assert timer.mean_tokens_per_s == pytest.approx(300 / 4.0)
    assert timer.median_step_time_s == pytest.approx(1.0)


def test_step_timer_shorter_than_warmup_uses_every_step_and_calls_sync():
    clock, synced = FakeClock(), []
    timer = StepTimer(warmup_steps=5, clock=clock, sync=lambda: synced.append(True))
    assert timer.mean_tokens_per_s is None
    timer.start()
    clock.now += 2.0
    timing = timer.stop(num_tokens=10)
    assert timing.data_time_s is None and synced == [True]
    assert timer.mean_tokens_per_s == pytest.approx(5.0)


# --- ProgressBar -----------------------------------------------------------------------------


def test_progress_in_a_log_prints_plain_lines_every_interval():
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(25, stream=stream, interval=10, clock=clock)
    for step in range(1, 26):
        clock.now += 1.0
        if step % 5 == 0 or step == 1:  # values only on logging steps: the bar keeps the last ones
            bar.update(step, loss=3.0 - step / 10, tokens_per_s=12345.0)
        else:
            bar.update(step)
    bar.write("eval loss 1.0")
    bar.close()
    out = stream.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == ["1/25", "10/25", "20/25", "25/25"]
    assert lines[1] == "step 10/25 (40%) | loss 2.0000 | 12.3k tok/s | elapsed 0:10 | eta 0:15"
    assert lines[0].endswith("eta ?") and lines[-1] == "eval loss 1.0"


def test_progress_in_a_terminal_redraws_one_line():
    stream, clock = io.StringIO(), FakeClock()
    with ProgressBar(100, stream=stream, is_tty=True, clock=clock, min_redraw_s=0.45) as bar:
        for step in range(1, 11):
            clock.now += 0.1
            bar.update(step, loss=1.0)  # drawn at step 1, then not before 0.45 s later: step 6
        bar.write("eval loss 0.5")
    out = stream.getvalue()
    assert out.startswith("\rstep 1/100 [--------------------]   1% | loss 1.0000")
    assert out.count("\rstep") == 3 and out.count("\rstep 6/100 [#-------------------]   6%") == 2
    assert "eval loss 0.5\n\rstep 6/100" in out  # the message, then the bar again below it
    assert out.count("\n") == 2 and out.endswith("\n")  # the message and close()


def test_progress_is_silent_off_rank0(capsys):
    bar = ProgressBar(10, rank=1)
    bar.update(10, loss=1.0)
    bar.write("x")
    bar.close()
    assert capsys.readouterr().out == ""


def test_eta_and_formatting():
    clock = FakeClock()
    bar = ProgressBar(100, stream=io.StringIO(), clock=clock)
    bar.update(1)
    clock.now = 10.0
    assert bar.eta_s(11) == pytest.approx(89.0)
    assert format_duration(89) == "1:29" and format_duration(3725) == "1:02:05"
    assert format_rate(950) == "950 tok/s" and format_rate(1.2e6) == "1.2M tok/s"
    with pytest.raises(ValueError, match="total_steps"):
        ProgressBar(0)
