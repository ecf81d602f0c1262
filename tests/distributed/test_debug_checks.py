"""The guide's table rows that are API misuse, on real gloo ranks: duplicated data, set_epoch
forgotten, DDP device_ids on a CPU module, an optimizer built before fully_shard, and a direct
model.forward() on an FSDP module. One spawn for all of them (the budget is a 2-core machine)."""

from __future__ import annotations

import contextlib
import io
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from meshrun.debug.data_check import DataDuplicationWarning, check_dataloader
from meshrun.debug.explain import explain, explain_exception
from meshrun.debug.optim_check import OptimizerMisuseError, check_optimizer, first_step_check
from meshrun.testing import run_distributed


def _data_checks() -> dict:
    data = TensorDataset(torch.arange(32.0).reshape(16, 2))
    out = {}
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(io.StringIO()) as err:
        warnings.simplefilter("always")
        out["plain_ok"] = check_dataloader(DataLoader(data, batch_size=4))  # no sampler: every rank the same
        sampler = DistributedSampler(data, shuffle=True, seed=1)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
        out["sharded_ok"] = check_dataloader(loader)
        for _ in range(2):  # two epochs, set_epoch forgotten
            list(loader)
        out["forgot_epoch_warned"] = sum("repeats the previous epoch" in str(w.message) for w in caught)
        good = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=1))
        check_dataloader(good)
        before = len(caught)
        for epoch in range(3):
            good.sampler.set_epoch(epoch)
            list(good)
        out["with_set_epoch_warnings"] = len(caught) - before
    out["dup_warned"] = any(isinstance(w.message, DataDuplicationWarning) and "identical first batch" in str(w.message)
                            for w in caught)
    out["marked"] = "meshrun: data warning:" in err.getvalue()
    return out


def _ddp_device_ids() -> str | None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        DDP(nn.Linear(2, 2), device_ids=[0])
    except ValueError as exc:
        return explain(type(exc).__name__, str(exc))
    return "no error"


def _fsdp_misuse() -> dict:
    from torch.distributed.fsdp import fully_shard

    out = {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    early = torch.optim.SGD(model.parameters(), lr=0.1)  # the mistake: before fully_shard
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    try:
        check_optimizer(model, early)
        out["early"] = "not detected"
    except OptimizerMisuseError as exc:
        out["early"] = str(exc)
    model(torch.randn(3, 4)).sum().backward()
    with contextlib.redirect_stderr(io.StringIO()) as err:
        first_step_check(early, (), {})
    out["first_step_warning"] = err.getvalue()
    check_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))  # the right order: no error
    try:
        model[0].forward(torch.randn(3, 4))  # direct forward on an FSDP module (resharded after backward)
        out["forward"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the text is what is checked
        out["forward"] = explain_exception(exc) or f"unexplained: {exc}"
    return out


def guide_rows() -> dict:
    return {"data": _data_checks(), "ddp": _ddp_device_ids(), "fsdp": _fsdp_misuse(), "rank": dist.get_rank()}


def test_guide_table_misuse_rows_are_explained():
    for result in run_distributed(guide_rows, world_size=2, timeout=120):
        data = result["data"]
        assert data["plain_ok"] is False and data["dup_warned"] and data["marked"]
        assert data["sharded_ok"] is True
        assert data["forgot_epoch_warned"] == 1
        assert data["with_set_epoch_warnings"] == 0
        assert "on CPU leave them out, DDP(model)" in result["ddp"]
        fsdp = result["fsdp"]
        assert "sharded with fully_shard after the optimizer was built" in fsdp["early"]
        assert "found no gradient on any of its 4 parameters" in fsdp["first_step_warning"]
        assert "call model(x) instead" in fsdp["forward"], fsdp["forward"]
