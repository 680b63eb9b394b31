"""LAMB with DeepSpeed FusedLamb's semantics.

Note [lamb trust ratio]
Per parameter (not per flat chunk: a chunk holds many parameters, and `Segments` says where each lies):
    m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g²
    u = m / (sqrt(v) + eps) + weight_decay * p          (eps_inside_sqrt: m / sqrt(v + eps))
    coeff = clamp(|p| / |u|, min_coeff, max_coeff), or 1 when |p| or |u| is 0
    p -= step_size * coeff * u,  step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)   (lr without bias_correction)
The moments themselves stay uncorrected and the trust ratio is taken on the uncorrected u, as in FusedLamb's
kernel; the bias correction scales the step only. The coefficients of the last step are kept
(`lamb_coeffs`, FusedLamb's get_lamb_coeffs()).
"""

from __future__ import annotations

import math

import torch

from engine.optimizers.segments import Segments


class Lamb(torch.optim.Optimizer):
    """LAMB (Note [lamb trust ratio]) over tensors that may each hold several parameters (`segments`)."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, segments: Segments | None = None):
        if min_coeff > max_coeff:
            raise ValueError(f"Lamb: min_coeff {min_coeff} is above max_coeff {max_coeff}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff))
        self.segments = segments or Segments()
        self.lamb_coeffs: list[float] = []

    def get_lamb_coeffs(self) -> list[float]:
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_tensor(p, group)
        return loss

    def _step_tensor(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(p.grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if group["eps_inside_sqrt"]:
            update = exp_avg / exp_avg_sq.add(group["eps"]).sqrt()
        else:
            update = exp_avg / exp_avg_sq.sqrt().add_(group["eps"])
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        step_size = group["lr"]
        if group["bias_correction"]:
            t = float(state["step"])
            step_size *= math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        for param, piece in self.segments.views(p, update):
            coeff = trust_ratio(param, piece, group["min_coeff"], group["max_coeff"])
            self.lamb_coeffs.append(coeff)
            param.add_(piece, alpha=-step_size * coeff)


def trust_ratio(param: torch.Tensor, update: torch.Tensor, min_coeff: float, max_coeff: float) -> float:
    """|param| / |update| clamped to [min_coeff, max_coeff]; 1 when either norm is 0."""
    w, u = float(param.norm()), float(update.norm())
    if w == 0 or u == 0:
        return 1.0
    return min(max(w / u, min_coeff), max_coeff)
