"""Disk faults as one line, not a crash: real failed writes under a file-size limit.

RLIMIT_FSIZE makes a write past the limit fail with EFBIG (Python ignores SIGXFSZ), so these
run as any user; tests/e2e/test_disk_full.py fills a real filesystem (root only).
"""

from __future__ import annotations

import contextlib
import errno
import json
import resource

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshrun.checkpoint import write_fault as wf
from meshrun.errors import DiskWriteError
from meshrun.launch import torch_elastic
from meshrun.metrics.logger import MetricsLogger

LIMIT = 64 * 1024


@contextlib.contextmanager
def file_size_limit(limit: int = LIMIT):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


BIG = {"w": torch.zeros(4 * LIMIT // 4)}  # 4x the limit


def test_torch_save_failure_is_found_behind_its_runtime_error(tmp_path):
    with file_size_limit():
        with pytest.raises(RuntimeError) as caught:
            torch.save(BIG, tmp_path / "x.pt")  # torch's zip writer: "unexpected pos ...", no errno
        found = wf.write_failure(caught.value)
        assert found is not None and found.errno == 0
        assert wf.with_errno(found, tmp_path, needed=4 * LIMIT).errno == errno.EFBIG  # read from the limit
    assert wf.write_failure(RuntimeError("shape mismatch")) is None  # a real bug stays a bug


def test_dcp_failure_names_the_path_and_the_limit(tmp_path):
    root = tmp_path / "checkpoints"
    tmp = root / "step-00000004.tmp-1"
    with file_size_limit(), pytest.raises(CheckpointException) as caught:
        dcp.save(BIG, checkpoint_id=str(tmp), no_dist=True)
    found = wf.write_failure(caught.value)
    assert found is not None
    error = wf.write_failed(found, tmp=tmp, root=root, needed=wf.state_bytes(BIG))
    text = str(error)
    assert isinstance(error, DiskWriteError) and error.exit_code == 1
    assert "checkpoint step-00000004 could not be written to" in text and str(tmp_path) in text
    assert "File too large (EFBIG)" in text and "ulimit -f" in text, text
    assert "needs about 256.0 KiB" in text and "no earlier checkpoint" in text, text


def test_metrics_write_failure_is_one_line_naming_the_file(tmp_path):
    metrics = MetricsLogger(tmp_path, rank=0, tensorboard=False)
    with file_size_limit(4096), pytest.raises(DiskWriteError) as caught:
        for step in range(1000):
            metrics.log_train(step, loss=1.0, note="x" * 100)
    metrics.close()  # the refused, still-buffered line does not fail the close
    assert f"a metrics row could not be written to {tmp_path / 'metrics.jsonl'}" in str(caught.value)
    assert "EFBIG" in str(caught.value)


@pytest.mark.parametrize("content", ["", '{"message": {"message": "Runtime', "[]", '{"x": 1}'])
def test_agent_reads_a_damaged_error_file_as_none(tmp_path, content):
    """An empty or partial error.json (a full disk) crashed torch's agent with JSONDecodeError."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / "error.json"
    path.write_text(content)
    with pytest.raises(Exception):  # noqa: B017 - torch's own reader: whatever the parse raises
        ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    with torch_elastic._tolerant_error_files():
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.error_file == str(path) and failure.message  # the path stays: the logs are found there
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"message": {"message": "E: x", "extraInfo": {"timestamp": "5"}}}))
    with torch_elastic._tolerant_error_files():
        assert ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(good)).timestamp == 5


class _Position:
    """The data position a checkpoint records (a plain stand-in for the run's loader)."""

    def state_dict(self) -> dict:
        return {"epoch": 0, "consumed": 0}


def test_failed_async_save_keeps_the_last_commit_and_latest(tmp_path):
    """A background (async) write past the limit: DiskWriteError at the wait, step 1 stays latest."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from meshrun.checkpoint import manifest as mf
    from meshrun.checkpoint.manager import Checkpointer
    from meshrun.checkpoint.state import TrainState
    from meshrun.config import CheckpointSection

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 64)).sum().backward()
        optimizer.step()
        state = TrainState([model], [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)],
                           _Position(), step=1)
        env = SimpleNamespace(rank=0, world_size=1, is_main=True, device=torch.device("cpu"))
        with Checkpointer(CheckpointSection(interval=1, async_save=True), run_dir=tmp_path, env=env,
                          layout={}) as ckpt:
            ckpt.root.mkdir(parents=True)
            ckpt.save(state, blocking=False)
            ckpt.finish(state)  # waits, commits step 1
            state.step = 2
            with file_size_limit(20_000):  # the RNG and train-state files fit, the tensors (~50 KB) do not
                ckpt.save(state, blocking=False)
                with pytest.raises(DiskWriteError, match="checkpoint step-00000002 could not be written"):
                    ckpt.finish(state)
    finally:
        dist.destroy_process_group()
    assert mf.read_latest(ckpt.root) == "step-00000001"
    assert [p.name for p in ckpt.root.iterdir() if p.is_dir()] == ["step-00000001"]  # no .tmp left
    assert mf.problem(ckpt.root / "step-00000001") is None


def test_final_weights_on_a_full_disk_are_one_line_and_leave_no_half_file(tmp_path):
    from types import SimpleNamespace

    from meshrun.train.derived import WEIGHTS_FILE, save_final_weights

    layout = SimpleNamespace(full_state_dict=lambda: dict(BIG))
    with file_size_limit(), pytest.raises(DiskWriteError) as caught:
        save_final_weights(layout, tmp_path, SimpleNamespace(is_main=True))
    text = str(caught.value)
    assert f"the final weights {WEIGHTS_FILE} could not be written to" in text and "EFBIG" in text, text
    assert "re-run the same command" in text and len(text.splitlines()) == 1
    assert not list(tmp_path.iterdir())  # no model.pt, no model.pt.tmp
