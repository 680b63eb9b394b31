"""1-bit Adam (DeepSpeed's OnebitAdam): full-precision Adam for freeze_step steps, then the variance frozen and the
momentum averaged over the ranks 1-bit compressed (Note [compressed allreduce], Note [optimizers that
communicate]).

Per step, with g the gradient (averaged by the engine in the warmup, this rank's own after it):
    m = b1 m + (1 - b1) g;  warmup: v = b2 v + (1 - b2) g²;  after: m = compressed average of m
    p -= lr (m / (sqrt(v) + eps) + weight_decay p)
No bias correction (DeepSpeed's OnebitAdam takes bias_correction and ignores it), eps outside the root.
"""

from __future__ import annotations

import enum
import logging

import torch

from engine.optimizers.compressed import CompressedOptimizer, DataParallelGroup
from engine.optimizers.segments import Segments

logger = logging.getLogger(__name__)


class OneBitPhase(enum.Enum):
    WARMUP = "warmup"  # full-precision Adam over gradients the engine averaged
    COMPRESSED = "compressed"  # variance frozen; momentum averaged 1-bit compressed


class OneBitAdam(CompressedOptimizer):
    def __init__(self, params, data_parallel: DataParallelGroup, lr: float = 1e-3, freeze_step: int = 100000,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, segments: Segments | None = None,
                 comm_backend_name: str = "nccl"):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay),
                         data_parallel, segments, comm_backend_name, "OneBitAdam")
        self.freeze_step = freeze_step
        self.phase = OneBitPhase.WARMUP

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        steps = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    steps = self._step_tensor(p, group)
        if self.phase is OneBitPhase.WARMUP and steps >= self.freeze_step:
            self._enter_compressed()
        return loss

    def _step_tensor(self, p: torch.Tensor, group: dict) -> int:
        state = self.state[p]
        if not state:  # scalars as 0-dim tensors: checkpoints keep tensors (Note [checkpoint layout])
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if self.phase is OneBitPhase.WARMUP:
            exp_avg.lerp_(p.grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        else:
            exp_avg.lerp_(self.local_grad(p), 1 - beta1)
            self.compressed_average_(exp_avg, p)
        update = exp_avg / exp_avg_sq.sqrt().add_(group["eps"])
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        p.add_(update, alpha=-group["lr"])
        return int(state["step"])

    def _enter_compressed(self) -> None:
        if self.data_parallel.rank == 0:
            logger.info("OneBitAdam: %d warmup steps done; the variance is frozen and the momentum is averaged "
                        "1-bit compressed from now on", self.freeze_step)
        self.phase = OneBitPhase.COMPRESSED
        self.engine_reduces_gradients = False

    def restore_phase(self) -> None:
        steps = max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)
        warm = steps < self.freeze_step
        self.phase = OneBitPhase.WARMUP if warm else OneBitPhase.COMPRESSED
        self.engine_reduces_gradients = warm
