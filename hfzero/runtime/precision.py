"""Dtype policy and fp16 loss scaling: one place decides what dtype each tensor has.

Parameters and gradients live in ``config.torch_dtype`` on the device. Master weights and the
optimizer step are fp32; with fp32 parameters and no offload the parameters are their own master
copy (no extra memory). Gradients are reduced as sums and divided by the world size (and unscaled)
only when converted to fp32 for the step, so 16-bit values never lose bits to a pre-division.
"""

from __future__ import annotations

import dataclasses

import torch

from hfzero.config import ZeroConfig

MASTER_DTYPE = torch.float32


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """Attributes:
    param_dtype: dtype of parameters and gradients on the device.
    master_dtype: dtype of master weights and optimizer states (always fp32).
    master_device: where master weights and optimizer states live (CPU when offloaded).
    separate_master: True when master weights are a copy (mixed precision or offload); False when
        the fp32 parameters on the device are updated in place.
    """

    param_dtype: torch.dtype
    master_dtype: torch.dtype
    master_device: torch.device
    separate_master: bool

    @classmethod
    def from_config(cls, config: ZeroConfig, device: torch.device, *, offload: bool = False) -> "PrecisionPolicy":
        """``offload``: the optimizer side is placed in host memory (runtime/offload.py decides when)."""
        master_device = torch.device("cpu") if offload else device
        separate = config.mixed_precision or offload
        return cls(config.torch_dtype, MASTER_DTYPE, master_device, separate)


class LossScaler:
    """Dynamic (or static) loss scaling for fp16; a scale of 1 that never changes otherwise.

    Dynamic: after an overflow (on any rank) the step is skipped; every ``hysteresis``-th overflow
    halves the scale (not below ``min_scale``); the overflow count restarts when the scale doubles,
    after ``window`` clean steps (DeepSpeed's default, non-consecutive hysteresis). Holds no tensor memory.
    """

    def __init__(self, config: ZeroConfig):
        self.enabled = config.dtype == "fp16"
        self.dynamic = self.enabled and config.loss_scale == 0
        self.scale = (config.loss_scale or config.initial_loss_scale) if self.enabled else 1.0
        self.window = config.loss_scale_window
        self.hysteresis = config.loss_scale_hysteresis
        self.min_scale = config.min_loss_scale
        self._good_steps = 0
        self._overflows_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Record one step's outcome and adapt the scale (dynamic mode only)."""
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self._overflows_left = self.hysteresis
            return
        self._good_steps += 1
        if self._good_steps >= self.window:
            self.scale *= 2.0
            self._good_steps = 0
            self._overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self._good_steps, "overflows_left": self._overflows_left}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._overflows_left = int(state["overflows_left"])
