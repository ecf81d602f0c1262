"""Mixed precision of the step: autocast as `train.dtype` says, and a gradient scaler for fp16.

bf16 and fp16 run the forward under `torch.autocast` (CPU included; FSDP also all-gathers the
parameters in that dtype, `MixedPrecisionPolicy`), while the weights the optimizer updates and
its state stay fp32. fp16's narrow range underflows small gradients, so the loss is multiplied
by a scale before backward and the gradients divided by it before clipping; a step whose
gradients overflow is skipped and the scale halved (Micikevicius et al., "Mixed Precision
Training", arXiv:1710.03740; https://docs.pytorch.org/docs/stable/amp.html#gradient-scaling).
With sharded gradients (FSDP, TP) every rank sees only its shard's overflow, so
`ShardedGradScaler` all-reduces the verdict and every rank skips the same steps.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from meshrun.parallel.resolve import torch_dtype


def autocast_context(device: torch.device, dtype: str):
    """bf16 / fp16 autocast on any device (CPU included); fp32 runs without autocast."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch_dtype(dtype))


class LossScaler:
    """torch's gradient scaler for one optimizer, counting the steps it skipped on overflow."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale (before clipping reads them)."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step unless the gradients overflowed, then update the scale; True if it stepped."""
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = self.scaler.get_scale() < before  # the scale only shrinks on an overflow
        self.skipped_steps += int(skipped)
        return not skipped

    def state_dict(self) -> dict:
        """Plain values (scale, growth tracker, ...): rank-independent, loadable with weights_only."""
        return {**self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.skipped_steps = int(state.pop("skipped_steps", 0))
        self.scaler.load_state_dict(state)


def build_loss_scaler(dtype: str, parts: list[nn.Module], device: torch.device, *,
                      init_scale: float) -> LossScaler | None:
    """A `LossScaler` for fp16 (None otherwise): `ShardedGradScaler` when any parameter is a
    DTensor shard (FSDP, TP), whose overflow check every rank must agree on; torch.amp's
    `GradScaler` for whole gradients (one process, DDP: identical after the all-reduce)."""
    if dtype != "fp16":
        return None
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for part in parts for p in part.parameters()):
        return LossScaler(_dtensor_scaler_class()(device=device.type, init_scale=init_scale))
    return LossScaler(torch.amp.GradScaler(device.type, init_scale=init_scale))


def _dtensor_scaler_class():
    """`ShardedGradScaler` made to work on DTensor gradients (FSDP2, TP), as torch 2.13's does not.

    Measured here: its unscale hands DTensor gradients and plain scale tensors to one kernel
    ("got mixed torch.Tensor and DTensor"), and a fused Adam on DTensors, to which GradScaler
    leaves the skip (`found_inf`), updates the weights anyway (NaN after an overflow). So this
    unscales each gradient's local shard in place, and skips the step itself for every optimizer;
    ShardedGradScaler still all-reduces the overflow flag, so every rank skips the same steps.
    """
    from torch.amp.grad_scaler import OptState
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor

    class DTensorGradScaler(ShardedGradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            found = {found_inf.device: found_inf}
            grads: dict[tuple, list[torch.Tensor]] = {}
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                        grads.setdefault((grad.device, grad.dtype), []).append(grad)
            with torch.no_grad():
                for (device, _), local in grads.items():
                    flag = found.setdefault(device, torch.zeros_like(found_inf, device=device))
                    torch._amp_foreach_non_finite_check_and_unscale_(local, flag, inv_scale.to(device))
            return found

        def step(self, optimizer, *args, **kwargs):
            state = self._per_optimizer_states[id(optimizer)]
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            result = self._maybe_opt_step(optimizer, state, *args, **kwargs)  # steps only if finite
            state["stage"] = OptState.STEPPED
            return result

    return DTensorGradScaler
