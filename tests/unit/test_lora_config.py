"""The [lora] keys: ranges, the layouts LoRA refuses (one line naming the key), the extra that
installs peft (targets that match nothing: tests/distributed/test_lora_parity.py, which imports peft)."""

from __future__ import annotations

import pytest

from meshrun.config import JobConfig
from meshrun.config.lora_section import DEFAULT_TARGETS, LoraSection
from meshrun.config.sections import ParallelSection
from meshrun.errors import ConfigError
from meshrun.extras import missing_extra_message

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(rank=-1), "lora.rank must be >= 0 (0 = off), got -1"),
    (dict(rank=4, alpha=0.0), "lora.alpha must be > 0, got 0.0"),
    (dict(rank=4, dropout=1.0), "lora.dropout must be in [0, 1), got 1.0"),
])
def test_lora_values_are_checked(kw, message):
    with pytest.raises(ConfigError, match=None) as err:
        LoraSection(**kw)
    assert str(err.value) == message


@pytest.mark.parametrize("degrees", [dict(tp=2), dict(pp=2)])
def test_lora_refuses_tensor_and_pipeline_parallel_in_one_line(degrees):
    key, degree = next(iter(degrees.items()))
    with pytest.raises(ConfigError) as err:
        JobConfig(lora=LoraSection(rank=8), parallel=ParallelSection(strategy="fsdp", **degrees))
    assert str(err.value).startswith(f"parallel.{key}={degree} with lora.rank=8: LoRA trains under data parallel")
    assert "\n" not in str(err.value)
    JobConfig(lora=LoraSection(rank=0), parallel=ParallelSection(strategy="fsdp", **degrees))  # LoRA off: fine


def test_lora_targets_and_extra():
    assert LoraSection(rank=4).target_names == DEFAULT_TARGETS
    assert LoraSection(rank=4, targets="wq, wv").target_names == ("wq", "wv")
    assert missing_extra_message("peft", "lora.rank=4") == "lora.rank=4 needs peft: pip install 'meshrun[lora]'"



def test_a_resume_on_other_base_weights_is_one_line():
    from types import SimpleNamespace

    from meshrun.checkpoint.manifest import CheckpointError
    from meshrun.checkpoint.state import check_base

    check_base(SimpleNamespace(base_fingerprint="ab12"), {"base_fingerprint": "ab12"}, "ckpt")  # the same base
    check_base(SimpleNamespace(base_fingerprint=None), {}, "ckpt")  # neither is a LoRA run
    for now, saved in (("cd34", "ab12"), (None, "ab12"), ("cd34", None)):
        with pytest.raises(CheckpointError) as err:
            check_base(SimpleNamespace(base_fingerprint=now), {"base_fingerprint": saved}, "ckpt")
        assert str(err.value).startswith("ckpt was trained on base weights with fingerprint ")
        assert "\n" not in str(err.value) and "checkpoint.resume=never" in str(err.value)
