"""0/1 Adam (DeepSpeed's ZeroOneAdam): the variance updated on a thinning schedule and then frozen, and after
that local steps with the parameters synchronized at growing intervals (Note [compressed allreduce],
Note [optimizers that communicate]).

Note [0/1 Adam schedule]
While the variance is live (steps up to var_freeze_step), step t updates it from gradients the engine averaged
when t divides by `var_interval`, which starts at 1 and doubles after every var_update_scaler such updates;
other steps update only the momentum, from the gradient averaged 1-bit compressed. After var_freeze_step the
engine averages nothing: each rank steps alone from its own gradient (the momentum too), keeping the sum of its
updates; when t divides by `local_step_interval` the ranks undo their local updates and apply instead the
compressed average of them (scaled by sqrt(v) + eps into momentum units; the momentum restarts as that average
over the summed learning rates). local_step_interval starts at 1 and doubles after every local_step_scaler local
steps, up to local_step_clipper. Every step: p -= lr (m / (sqrt(v) + eps) + weight_decay p), no bias correction
(DeepSpeed reads bias_correction nowhere). The compression errors are reset when the local steps begin, as they
hold gradient errors until then.
"""

from __future__ import annotations

import enum
import logging

import torch

from engine.optimizers.compressed import CompressedOptimizer, DataParallelGroup
from engine.optimizers.segments import Segments

logger = logging.getLogger(__name__)


# the schedule's counters (Note [0/1 Adam schedule]) and their starting values; lrs sums the learning rates of the
# local steps since the last synchronization
_COUNTERS = {"step": 0, "var_interval": 1, "var_counter": 0, "local_step_interval": 1, "local_step_counter": 0,
             "lrs": 0.0}


def _number(name: str, value: torch.Tensor) -> float | int:
    return float(value) if name == "lrs" else int(value)


class ZeroOnePhase(enum.Enum):
    VARIANCE = "variance"  # the variance updated on var_interval steps; the momentum every step
    LOCAL_STEPS = "local steps"  # variance frozen; ranks step alone and synchronize every local_step_interval


class ZeroOneAdam(CompressedOptimizer):
    def __init__(self, params, data_parallel: DataParallelGroup, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 segments: Segments | None = None, comm_backend_name: str = "nccl"):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay),
                         data_parallel, segments, comm_backend_name, "ZeroOneAdam")
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.phase = ZeroOnePhase.VARIANCE

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        reduce_next, steps = True, 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    steps, reduce_next = self._step_tensor(p, group)
        self.engine_reduces_gradients = reduce_next
        if self.phase is ZeroOnePhase.VARIANCE and steps > self.var_freeze_step:
            self._begin_local_steps()
        return loss

    def _state(self, p: torch.Tensor) -> dict:
        """The tensor states, and the schedule's counters as plain numbers (kept as 0-dim tensors in the state:
        checkpoints keep tensors, Note [checkpoint layout]; written back by _store_counters)."""
        state = self.state[p]
        if not state:
            state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                         momentum_accumulator=torch.zeros_like(p),
                         **{name: torch.tensor(float(start)) for name, start in _COUNTERS.items()})
        return {**state, **{name: _number(name, state[name]) for name in _COUNTERS}}

    def _store_counters(self, p: torch.Tensor, counters: dict) -> None:
        for name in _COUNTERS:
            self.state[p][name].fill_(counters[name])

    def _step_tensor(self, p: torch.Tensor, group: dict) -> tuple[int, bool]:
        state = self._state(p)
        state["step"] += 1
        try:
            return state["step"], self._step_with(p, group, state)
        finally:
            self._store_counters(p, state)

    def _step_with(self, p: torch.Tensor, group: dict, state: dict) -> bool:
        t, beta1, beta2 = state["step"], *group["betas"]
        exp_avg, exp_avg_sq, accumulated = state["exp_avg"], state["exp_avg_sq"], state["momentum_accumulator"]
        local = self.phase is ZeroOnePhase.LOCAL_STEPS
        if local:
            exp_avg.lerp_(self.local_grad(p), 1 - beta1)
            state["lrs"] += group["lr"]
        elif t % state["var_interval"] == 0:  # the engine averaged this step's gradients
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            exp_avg.lerp_(p.grad, 1 - beta1)
        else:
            exp_avg.lerp_(self.compressed_average_(self.local_grad(p).clone(), p), 1 - beta1)
        denominator = exp_avg_sq.sqrt().add_(group["eps"])
        update = exp_avg / denominator
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        p.add_(update, alpha=-group["lr"])
        if local:
            accumulated.add_(update, alpha=-group["lr"])
            if t % state["local_step_interval"] == 0:
                self._synchronize(p, state, denominator)
        return self._advance_schedule(state, t, local)

    def _synchronize(self, p: torch.Tensor, state: dict, denominator: torch.Tensor) -> None:
        """Replaces this rank's local updates since the last synchronization by their compressed average."""
        accumulated = state["momentum_accumulator"]
        p.sub_(accumulated)
        self.compressed_average_(accumulated.mul_(denominator), p)
        state["exp_avg"].copy_(accumulated).div_(-state["lrs"])
        p.add_(accumulated / denominator)
        accumulated.zero_()
        state["lrs"] = 0.0

    def _advance_schedule(self, state: dict, t: int, local: bool) -> bool:
        """Note [0/1 Adam schedule]: the intervals after step t; whether the engine averages step t + 1's
        gradients."""
        if local:
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
            return False
        if t % state["var_interval"] == 0:
            state["var_counter"] += 1
            if state["var_counter"] == self.var_update_scaler:
                state["var_counter"] = 0
                state["var_interval"] *= 2
        return (t + 1) % state["var_interval"] == 0

    def _begin_local_steps(self) -> None:
        if self.data_parallel.rank == 0:
            logger.info("ZeroOneAdam: past var_freeze_step %d; the variance is frozen and the ranks take local "
                        "steps, synchronized 1-bit compressed", self.var_freeze_step)
        self.phase = ZeroOnePhase.LOCAL_STEPS
        self.engine_reduces_gradients = False
        self.reset_errors()

    def restore_phase(self) -> None:
        states = [s for s in self.state.values() if "step" in s]
        if not states:
            return
        step, interval = int(states[0]["step"]), int(states[0]["var_interval"])
        local = step > self.var_freeze_step
        self.phase = ZeroOnePhase.LOCAL_STEPS if local else ZeroOnePhase.VARIANCE
        self.engine_reduces_gradients = not local and (step + 1) % interval == 0
