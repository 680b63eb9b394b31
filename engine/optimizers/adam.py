"""Adam / AdamW without bias correction (`optimizer.params.bias_correction: false`)."""

from __future__ import annotations

import torch


class UncorrectedAdam(torch.optim.Optimizer):
    """Adam whose moments are used as they are, with no 1 - beta^t correction (DeepSpeed FusedAdam with
    bias_correction=False):

        m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g²,  p -= lr (m / (sqrt(v) + eps))

    decoupled=True (AdamW) first shrinks p by lr * weight_decay; decoupled=False (Adam) adds weight_decay * p to g.
    State keys match torch.optim.Adam's (step, exp_avg, exp_avg_sq)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 decoupled: bool = True):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled=decoupled))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                if wd and group["decoupled"]:
                    p.mul_(1 - lr * wd)
                elif wd:
                    grad = grad.add(p, alpha=wd)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                p.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(group["eps"]), value=-lr)
        return loss
