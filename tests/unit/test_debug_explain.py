"""`got mixed torch.Tensor and DTensor` has several causes: meshrun gives the fix for the one the
traceback's frames show (an optimizer step, clip_grad_norm_, a direct model.forward), and only
names the common causes when they show none.

The messages and frames are torch 2.13's own, recorded on CPU/gloo with one rank: `model.forward(x)`
on a fully_shard'ed Sequential, AdamW/SGD(foreach=True) over a model whose root was not sharded
(or with an extra plain parameter), clip_grad_norm_ over the same, and a sharded weight + a tensor.
"""

from __future__ import annotations

import traceback

import pytest

from meshrun.debug.explain import (
    MIXED_FORWARD,
    MIXED_IN_CLIP,
    MIXED_IN_OPTIMIZER,
    MIXED_UNKNOWN,
    explain,
    explain_exception,
)

TORCH = "/venv/lib/python3.11/site-packages/torch"
MIXED = ("{op} got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before "
         "calling distributed operators!")


def _frames(*rows: tuple[str, str, str]) -> list[traceback.FrameSummary]:
    return [traceback.FrameSummary(path, n + 1, name, lookup_line=False, line=line)
            for n, (path, name, line) in enumerate(rows)]


USER_STEP = ("/home/u/train.py", "<module>", "opt.step()")
ADAMW = _frames(USER_STEP,
                (f"{TORCH}/optim/optimizer.py", "wrapper", "out = func(*args, **kwargs)"),
                (f"{TORCH}/optim/adam.py", "step", "adam("),
                (f"{TORCH}/optim/adam.py", "_multi_tensor_adam",
                 "torch._foreach_mul_(device_params, 1 - lr * weight_decay)"))
SGD = _frames(USER_STEP,
              (f"{TORCH}/optim/sgd.py", "step", "sgd("),
              (f"{TORCH}/optim/sgd.py", "_multi_tensor_sgd", "torch._foreach_add_(device_params, device_grads)"))
CLIP = _frames(("/home/u/train.py", "step", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"),
               (f"{TORCH}/nn/utils/clip_grad.py", "clip_grad_norm_", "total_norm = _get_total_norm(grads)"),
               (f"{TORCH}/nn/utils/clip_grad.py", "_get_total_norm",
                "norms.extend(torch._foreach_norm(device_tensors, norm_type))"))
DIRECT_FORWARD = _frames(("/home/u/train.py", "<module>", "out = model.forward(x)"),
                         (f"{TORCH}/nn/modules/container.py", "forward", "input = module(input)"),
                         (f"{TORCH}/nn/modules/module.py", "_wrapped_call_impl", "return self._call_impl(*args)"),
                         (f"{TORCH}/nn/modules/module.py", "_call_impl", "return forward_call(*args, **kwargs)"),
                         (f"{TORCH}/nn/modules/linear.py", "forward",
                          "return F.linear(input, self.weight, self.bias)"))
# model(x), then a user forward that adds a plain tensor to a sharded weight: no direct forward call
CALLED = _frames(("/home/u/train.py", "<module>", "out = model(x)"),
                 (f"{TORCH}/nn/modules/module.py", "_wrapped_call_impl", "return self._call_impl(*args)"),
                 (f"{TORCH}/nn/modules/module.py", "_call_impl", "return forward_call(*args, **kwargs)"),
                 ("/home/u/model.py", "forward", "return super().forward(x) + self.bias_table"),
                 ("/home/u/model.py", "forward", "return self.weight + x"))


@pytest.mark.parametrize(("op", "frames", "expected"), [
    ("aten._foreach_mul_.Scalar", ADAMW, MIXED_IN_OPTIMIZER),
    ("aten._foreach_add_.List", SGD, MIXED_IN_OPTIMIZER),
    ("aten._foreach_norm.Scalar", CLIP, MIXED_IN_CLIP),
    ("aten.addmm.default", DIRECT_FORWARD, MIXED_FORWARD),
    ("aten.add.Tensor", CALLED, MIXED_UNKNOWN),
    ("aten.addmm.default", None, MIXED_UNKNOWN),  # no frames: no cause asserted
    ("aten.addmm.default", [], MIXED_UNKNOWN),
])
def test_mixed_dtensor_fix_follows_the_frames(op, frames, expected):
    assert explain("RuntimeError", MIXED.format(op=op), frames) == expected


def test_each_cause_gets_its_own_fix():
    assert "build the optimizer after fully_shard" in MIXED_IN_OPTIMIZER and "model.forward" not in MIXED_IN_OPTIMIZER
    assert "call model(x) instead" in MIXED_FORWARD
    assert "model(x) instead" not in MIXED_IN_CLIP and "fully_shard to the root module" in MIXED_IN_CLIP
    # the neutral line names the causes without asserting one
    assert "common causes" in MIXED_UNKNOWN and "call model(x) instead" not in MIXED_UNKNOWN


def test_a_direct_forward_inside_torch_is_not_the_users():
    # torch's own wrappers may call .forward( on a module: not the user's direct call
    frames = _frames(("/home/u/train.py", "<module>", "out = model(x)"),
                     (f"{TORCH}/distributed/pipelining/stage.py", "forward_one_chunk", "self.submod.forward(x)"),
                     (f"{TORCH}/nn/modules/linear.py", "forward", "return F.linear(input, self.weight)"))
    assert explain("RuntimeError", MIXED.format(op="aten.addmm.default"), frames) == MIXED_UNKNOWN


def test_explain_exception_reads_the_frames_of_a_real_traceback():
    class Layer:
        def forward(self, x):
            raise RuntimeError(MIXED.format(op="aten.addmm.default"))

    layer = Layer()
    try:
        layer.forward(1)  # the direct call, as a user's script makes it
    except RuntimeError as exc:
        assert explain_exception(exc) == MIXED_FORWARD
    try:
        raise RuntimeError(MIXED.format(op="aten.add.Tensor"))
    except RuntimeError as exc:
        assert explain_exception(exc) == MIXED_UNKNOWN


def test_other_errors_keep_their_single_fix():
    assert "on CPU leave them out" in explain("ValueError", "device_ids and output_device arguments only work "
                                              "with x module parameters {device(type='cpu')}", ADAMW)
    assert explain("ValueError", "bad batch", ADAMW) is None
