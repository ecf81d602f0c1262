"""train.compile's pure pieces in one process: the setting, the cache variables, the layout rule,
and what a block that fails to compile does under true and "auto" (dynamo refuses a graph break
under fullgraph before inductor runs, so this needs no C++ compile)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from meshrun.config import load_config
from meshrun.errors import ConfigError
from meshrun.parallel.compile import (
    CACHE_DIR,
    CompileError,
    apply_compile,
    layout_allows,
    mode,
    use_run_cache,
)


def test_setting_parses_false_true_and_auto(tmp_path):
    path = tmp_path / "c.toml"
    for text, want in (("false", False), ("true", True), ('"auto"', None)):
        path.write_text(f"[train]\ncompile = {text}\n")
        assert load_config(path).train.compile is want
    assert [mode(v) for v in (False, True, None)] == ["off", "on", "auto"]
    with pytest.raises(ConfigError, match="train.compile must be true or false"):
        load_config(path, ["train.compile=sometimes"])


def test_cache_goes_to_the_run_dir_unless_the_user_chose_one(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env: dict[str, str] = {}
    assert use_run_cache(tmp_path, env) == tmp_path.resolve() / CACHE_DIR
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    env = {"TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}  # what importing torch._dynamo writes
    assert use_run_cache(tmp_path, env) == tmp_path.resolve() / CACHE_DIR
    mine = str(tmp_path / "mine")
    env = {"TORCHINDUCTOR_CACHE_DIR": mine, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    assert str(use_run_cache(tmp_path, env)) == mine and env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"


def test_tp_without_sequence_parallel_is_refused_for_true_and_eager_for_auto(caplog):
    with pytest.raises(ConfigError, match=r"train.compile must be false with parallel.tp > 1 unless parallel.sequence_parallel=true"):
        layout_allows(True, 2, False)
    with caplog.at_level(logging.WARNING):
        assert layout_allows(None, 2, False) is False
    assert "training eagerly" in caplog.text
    assert layout_allows(True, 2, True) and layout_allows(None, 1, False) and not layout_allows(False, 1, False)


def test_auto_warns_on_rank_0_only(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # no process group here: the launcher's RANK says which rank this is
    with caplog.at_level(logging.WARNING):
        assert layout_allows(None, 2, False) is False
    assert caplog.text == ""


class _Breaks(nn.Module):
    def forward(self, x):
        torch._dynamo.graph_break()  # fullgraph=True refuses this at the first call
        return x * 2


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Breaks()})

    def forward(self, x):
        return self.layers["0"](x)


def test_a_block_that_fails_to_compile_is_an_error_for_true_and_eager_for_auto(caplog):
    x = torch.ones(3)
    model = _Model()
    assert apply_compile(model, True, backend="eager") == ["layers.0"]
    with pytest.raises(CompileError, match=r"^train.compile: compiling layers.0 failed: .+; set train.compile=\"auto\""):
        model(x)
    model = _Model()
    apply_compile(model, None, backend="eager")
    with caplog.at_level(logging.WARNING):
        assert torch.equal(model(x), x * 2)
    assert "compiling layers.0 failed" in caplog.text and "runs eagerly" in caplog.text
    assert model.layers["0"]._compiled_call_impl is None  # eager from now on: no second attempt
    assert apply_compile(_Model(), False) == []
