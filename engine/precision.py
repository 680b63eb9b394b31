"""Dtype policy (autocast) and loss scaling, as DeepSpeed's fp16/bf16 sections describe them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from engine.config import Config


@dataclass(frozen=True)
class PrecisionPolicy:
    """Compute dtype for the forward and of the parameter and gradient chunks; master weights and optimizer
    states stay fp32. `autocast_dtype`: DeepSpeed's torch_autocast, the forward under autocast with fp32 chunks."""

    compute_dtype: torch.dtype
    cast_inputs: bool = False  # fp16.auto_cast: floating positional forward arguments cast to fp16, as DeepSpeed does
    autocast_dtype: torch.dtype | None = None

    @classmethod
    def from_config(cls, config: Config) -> "PrecisionPolicy":
        if config.fp16.enabled:
            return cls(torch.float16, cast_inputs=config.fp16.auto_cast)
        if config.bf16.enabled:  # (with torch_autocast to bf16 too: the forward runs under it either way)
            return cls(torch.bfloat16)
        if config.torch_autocast.enabled:  # bf16 only (config_checks): no loss scaling needed
            return cls(torch.float32, autocast_dtype=torch.bfloat16)
        return cls(torch.float32)

    def forward_args(self, args: tuple) -> tuple:
        """The positional forward arguments, their floating tensors (in nested lists, tuples, dicts) cast to fp16
        under fp16.auto_cast (DeepSpeed casts these, not the keyword arguments)."""
        return _half(args) if self.cast_inputs else args

    def autocast(self, device: torch.device):
        dtype = self.autocast_dtype or self.compute_dtype
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)


def _half(value):
    if isinstance(value, torch.Tensor):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_half(v) for v in value)
    if isinstance(value, dict):
        return {k: _half(v) for k, v in value.items()}
    return value


class LossScaler:
    """No scaling (fp32, bf16): scale 1 and no step is ever skipped."""

    checks_overflow = False

    def __init__(self) -> None:
        self.scale = 1.0

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class StaticLossScaler(LossScaler):
    """fp16 with a fixed `loss_scale`: overflowing steps are skipped, the scale never moves."""

    checks_overflow = True

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic scaler.

    On overflow the step is skipped; the scale halves (not below min_scale) once `hysteresis`
    overflows have been seen, otherwise one unit of hysteresis is spent. After `window` steps
    without overflow the scale doubles, up to max_scale when one is given (and, unless
    consecutive_hysteresis, the hysteresis is refilled then; with it, every clean step refills it).
    """

    checks_overflow = True

    def __init__(self, initial_scale: float, window: int, hysteresis: int, min_scale: float,
                 consecutive_hysteresis: bool = False, factor: float = 2.0, max_scale: float | None = None) -> None:
        self.scale = float(initial_scale)
        self.max_scale = max_scale
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.factor = factor
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale <= self.min_scale:
                    raise FloatingPointError(
                        f"fp16 gradients overflow even at the minimum loss scale {self.min_scale:g} (DeepSpeed stops "
                        "here too); lower fp16.min_loss_scale, use bf16, or look for a diverging loss")
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
                if self.max_scale:
                    self.scale = min(self.scale, self.max_scale)
        self.iteration += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])


def build_loss_scaler(config: Config) -> LossScaler:
    fp16 = config.fp16
    if config.bf16.enabled and config.bf16.check_grad_overflow:
        return StaticLossScaler(1.0)  # DeepSpeed's bf16 overflow check: skip the step, nothing to rescale
    if not fp16.enabled:
        return LossScaler()
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(2.0 ** fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
                             fp16.min_loss_scale, fp16.consecutive_hysteresis, max_scale=fp16.max_loss_scale or None)
