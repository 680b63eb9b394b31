"""DeepSpeed-compatible learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle.

The formulas, defaults and iteration convention follow DeepSpeed's `runtime/lr_schedules.py`, so a
run configured the same way sees the same lr sequence and a DeepSpeed `last_batch_iteration`
checkpoint resumes here unchanged.

Iteration convention (DeepSpeed's): `last_batch_iteration` is -1 after construction and is
incremented by every `step()`, which is meant to follow each optimizer step. Each schedule
is a pure function `lr_at(iteration)` of that counter, and the optimizer always holds
`lr_at(last_batch_iteration)`. So the first optimizer step runs at `lr_at(-1)` (DeepSpeed's
"before start" value: the warmup floor, or 0 for WarmupCosineLR), the second at `lr_at(0)`.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from numbers import Real

import torch

WARMUP_TYPES = ("log", "linear")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()  # default marker for params the config must give

# Integer params and their smallest legal value (0 step sizes would divide by zero).
_INT_MINIMUMS = {
    "warmup_num_steps": 0, "total_num_steps": 0, "cycle_first_step_size": 1,
    "cycle_second_step_size": 1, "cycle_first_stair_count": 0, "cycle_second_stair_count": 0,
    "decay_step_size": 0,
}


def _per_group(optimizer: torch.optim.Optimizer, value, name: str) -> list:
    """A scalar applies to every param group; a list/tuple gives one value per group."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"scheduler.params.{name}: expected {n} values (one per param group), got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * n


def _warmup_fraction(iteration: int, num_steps: int, warmup_type: str) -> float:
    """Progress through warmup, 0 at iteration 0 (log reaches 1 at num_steps - 1, linear never does)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


def _assign(group: dict, key: str, value: float) -> None:
    # Tensor hyper-parameters (capturable / compiled optimizers) must be updated in place.
    if isinstance(group[key], torch.Tensor):
        group[key].fill_(value)
    else:
        group[key] = value


class LRSchedule:
    """Base: subclasses define `lr_at` (and optionally `momentum_at`) as pure functions."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.last_batch_iteration = -1
        self._apply()

    def lr_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def momentum_at(self, iteration: int) -> list[float] | None:
        return None

    def get_lr(self) -> list[float]:
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance past one optimizer step (or jump to `batch_iteration`) and set the next lr."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if batch_iteration is None else int(batch_iteration)
        self._apply()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        # Re-applying makes the optimizer right even if its own state is not restored.
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()

    def _apply(self) -> None:
        groups = self.optimizer.param_groups
        self._last_lr = self.lr_at(self.last_batch_iteration)
        for group, lr in zip(groups, self._last_lr):
            _assign(group, "lr", lr)
        moms = self.momentum_at(self.last_batch_iteration)
        for group, mom in zip(groups, moms or ()):
            if "betas" in group:  # Adam-like: beta1 is the momentum, beta2 is left alone
                beta1, beta2 = group["betas"]
                if isinstance(beta1, torch.Tensor):
                    beta1.fill_(mom)
                else:
                    group["betas"] = (mom, beta2)
            else:
                _assign(group, "momentum", mom)


class WarmupLR(LRSchedule):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log"):
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))  # log(1) = 0 would divide by zero
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return self._after_warmup(iteration)

    def _after_warmup(self, iteration: int) -> float:
        return 1.0

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:  # not started: DeepSpeed holds the floor
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay back to warmup_min_lr at total_num_steps (held there after)."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log"):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            logging.getLogger(__name__).warning(
                "total_num_steps %d is less than warmup_num_steps %d", self.total_num_steps, self.warmup_num_steps)

    def _after_warmup(self, iteration: int) -> float:
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / span)


class WarmupCosineLR(LRSchedule):
    """Scale the optimizer's own lr by a ratio: warm up warmup_min_ratio -> 1, then cosine to cos_min_ratio."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type="log"):
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        # The peak is the lr the optimizer was built with; keeping it in the group (like torch's
        # schedulers do) means it survives loading optimizer state before building the schedule.
        self.peak_lrs = [float(g.setdefault("initial_lr", g["lr"])) for g in optimizer.param_groups]
        super().__init__(optimizer)

    def ratio_at(self, iteration: int) -> float:
        if iteration < 0:  # not started: DeepSpeed uses 0, not warmup_min_ratio
            return 0.0
        if iteration < self.warmup_num_steps:
            frac = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * frac
        # Progress is clamped so the ratio rests at cos_min_ratio past total_num_steps.
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, iteration: int) -> list[float]:
        ratio = self.ratio_at(iteration)
        return [peak * ratio for peak in self.peak_lrs]


class OneCycle(LRSchedule):
    """1Cycle: lr rises min->max over the first half, falls back over the second, then decays.

    Momentum moves inversely (max->min->max). Iteration i sits at position i + 1 of the cycle,
    so the constructed state (i = -1) is the cycle start.
    """

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9,
                 decay_mom_rate=0.0):
        self.first_size = float(cycle_first_step_size)
        self.second_size = self.first_size if cycle_second_step_size is None else float(cycle_second_step_size)
        self.total_size = self.first_size + self.second_size
        self.first_stairs = int(cycle_first_stair_count)
        self.second_stairs = self.first_stairs if cycle_second_stair_count is None else int(cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        # A zero step size or zero rate means "no post-cycle decay" (DeepSpeed's skip flags).
        self.decay_lr_rate = 0.0 if decay_step_size == 0 else float(decay_lr_rate)
        self.decay_mom_rate = 0.0 if decay_step_size == 0 else float(decay_mom_rate)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and not ({"betas", "momentum"} & optimizer.defaults.keys()):
            logging.getLogger(__name__).warning(
                "cycle_momentum disabled: %s has neither 'betas' nor 'momentum'", type(optimizer).__name__)
            self.cycle_momentum = False
        super().__init__(optimizer)

    def scale_at(self, iteration: int) -> float:
        """Height within the cycle in [0, 1]: 0 at the ends, 1 at the peak."""
        pos = (iteration + 1) % self.total_size
        rising = pos <= self.first_size
        size, stairs = (self.first_size, self.first_stairs) if rising else (self.second_size, self.second_stairs)
        dist = pos if rising else self.total_size - pos
        if stairs > 0:  # hold flat within each stair; quantise the integer position, not the float scale
            return math.floor(dist * stairs / size) / stairs
        return dist / size

    def _decay_interval(self, iteration: int) -> float:
        return (iteration - self.total_size + 1) / self.decay_step_size

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self.scale_at(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_lr_rate == 0.0:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval(iteration)
        return [lo / factor for lo in self.min_lrs]

    def momentum_at(self, iteration: int) -> list[float] | None:
        if not self.cycle_momentum:
            return None
        if iteration < self.total_size:
            scale = self.scale_at(iteration)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_mom_rate == 0.0:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval(iteration)
        return [hi * factor for hi in self.max_moms]


_SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)}

# Schedule name -> {param: default}; taken from the constructors so there is one source of truth.
SCHEDULE_PARAMS: dict[str, dict[str, object]] = {
    name: {
        p.name: REQUIRED if p.default is inspect.Parameter.empty else p.default
        for p in list(inspect.signature(cls.__init__).parameters.values())[2:]  # skip self, optimizer
    }
    for name, cls in _SCHEDULES.items()
}


def _check_value(key: str, value) -> None:
    path = f"scheduler.params.{key}"
    if key == "warmup_type":
        if value not in WARMUP_TYPES:
            raise ValueError(f"{path}: {value!r} is not one of {', '.join(map(repr, WARMUP_TYPES))}")
    elif key == "cycle_momentum":
        if not isinstance(value, bool):
            raise ValueError(f"{path}: expected true/false, got {value!r}")
    elif key in _INT_MINIMUMS:
        low = _INT_MINIMUMS[key]
        if value is None and key.startswith("cycle_second"):  # None means "same as the first half"
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{path}: expected an integer >= {low}, got {value!r}")
    else:
        values = value if isinstance(value, (list, tuple)) else [value]
        if not values or any(isinstance(v, bool) or not isinstance(v, Real) for v in values):
            raise ValueError(f"{path}: expected a number, got {value!r}")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, name: str, params: dict) -> LRSchedule:
    """Validate `params` against `name`'s schedule, fill defaults, and build it on `optimizer`."""
    if name not in SCHEDULE_PARAMS:
        guess = difflib.get_close_matches(str(name), list(SCHEDULE_PARAMS), n=1, cutoff=0.5)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        raise ValueError(f"scheduler.type: {name!r} is not one of {', '.join(map(repr, SCHEDULE_PARAMS))}{hint}")
    allowed = SCHEDULE_PARAMS[name]
    params = dict(params or {})
    for key in params:
        if key not in allowed:
            guess = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.5)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            raise ValueError(f"scheduler.params: {name} has no parameter {key!r}{hint}; "
                             f"allowed: {', '.join(map(repr, allowed))}")
    for key, default in allowed.items():
        if default is REQUIRED and key not in params:
            raise ValueError(f"scheduler.params: {name} requires {key!r}")
    for key, value in params.items():
        _check_value(key, value)
    return _SCHEDULES[name](optimizer, **{**allowed, **params})
