"""colossalai.nn.lr_scheduler.CosineAnnealingWarmupLR, ColossalAI's formula: with η the learning rate the optimizer
had when the scheduler was built, W warmup steps and T = total_steps - W, after k calls of step() the rate is
(k + 1) / W · η while k < W, then eta_min + (η - eta_min) · (1 + cos(π (k - W) / T)) / 2 (η again at k = W; not
held after total_steps, where the cosine rises again, as ColossalAI's does)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


class CosineAnnealingWarmupLR(LambdaLR):
    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 eta_min: float = 0.0, last_epoch: int = -1):
        if total_steps <= warmup_steps:
            raise ValueError(f"CosineAnnealingWarmupLR: total_steps {total_steps} must exceed warmup_steps "
                             f"{warmup_steps} (the cosine runs over the steps after the warmup)")
        self.total_steps, self.warmup_steps, self.eta_min = total_steps, warmup_steps, eta_min
        base = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, [self._factor_for(lr) for lr in base], last_epoch)

    def _factor_for(self, eta: float):
        warmup, span, floor = self.warmup_steps, self.total_steps - self.warmup_steps, self.eta_min

        def factor(k: int) -> float:
            if k < warmup:
                return (k + 1) / warmup
            cosine = floor + (eta - floor) * (1 + math.cos(math.pi * (k - warmup) / span)) / 2
            return cosine / eta if eta else 0.0
        return factor
