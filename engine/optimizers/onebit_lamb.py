"""1-bit LAMB (DeepSpeed's OnebitLamb): LAMB for freeze_step steps, then the momentum averaged 1-bit compressed with
the trust ratio frozen and adjusted by a bounded factor (Note [compressed allreduce], Note [optimizers that
communicate]).

Note [1-bit lamb]
Warmup, from gradients the engine averaged: per parameter (Note [lamb trust ratio], but with no bias correction:
DeepSpeed's OnebitLamb reads bias_correction nowhere) m, v and u = m / (sqrt(v) + eps) + weight_decay p; the ratio
r = clamp(|p| / |u|, min_coeff, max_coeff) steps p -= lr r u, and an average of the ratios is kept,
frozen = coeff_beta frozen + (1 - coeff_beta) r (ratios of exactly 1 are left out). The variance at freeze_step
is copied as a "fresh" variance.
Compression stage, from each rank's own gradient: at its first step each parameter gets a scaling coefficient,
the mean over parameters of their momentum RMS over its own, so that one compression scale fits them all; then
each step m = b1 m + (1 - b1) g is scaled by it, the momenta of all parameters are averaged as one 1-bit
compressed message, and unscaled. The gradient that momentum implies, (m - b1 m_prev) / (1 - b1), updates the
fresh variance; the frozen variance still gives u. The factor max(denominator / fresh denominator) (mixed toward 1
by |m / denominator| / |u| when there is weight decay) is clamped to [factor_min, factor_max] and to within
factor_threshold of the last factor; p -= lr frozen factor u.
"""

from __future__ import annotations

import enum
import logging

import torch

from engine.optimizers.compressed import CompressedOptimizer, DataParallelGroup
from engine.optimizers.compressed_comm import CompressedAverager
from engine.optimizers.lamb import trust_ratio
from engine.optimizers.segments import Segments

logger = logging.getLogger(__name__)


class OneBitLambPhase(enum.Enum):
    WARMUP = "warmup"
    COMPRESSED = "compressed"


class OneBitLamb(CompressedOptimizer):
    def __init__(self, params, data_parallel: DataParallelGroup, lr: float = 1e-3, freeze_step: int = 100000,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, segments: Segments | None = None, comm_backend_name: str = "nccl"):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff),
                         data_parallel, segments, comm_backend_name, "OneBitLamb")
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.phase = OneBitLambPhase.WARMUP
        self.lamb_coeffs: list[float] = []
        self._fused: CompressedAverager | None = None  # every parameter's momentum as one message

    def get_lamb_coeffs(self) -> list[float]:
        return list(self.lamb_coeffs)

    def _stepped(self) -> list[tuple[torch.Tensor, dict]]:
        return [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]

    def _state(self, p: torch.Tensor) -> dict:
        """Per parameter values (lamb_coeff_freeze, last_factor, scaling_coeff) fill that parameter's elements of a
        tensor laid out as p, and the step is a 0-dim tensor: checkpoints keep such tensors, element by element
        (Note [checkpoint layout])."""
        state = self.state[p]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                         exp_avg_sq_fresh=torch.zeros_like(p), lamb_coeff_freeze=torch.zeros_like(p),
                         last_factor=torch.ones_like(p))
        return state

    def _per_parameter(self, p: torch.Tensor, name: str) -> list[float]:
        return [float(piece[0]) for _, piece in self.segments.views(p, self.state[p][name])]

    def _set_per_parameter(self, p: torch.Tensor, name: str, values: list[float]) -> None:
        for (_, piece), value in zip(self.segments.views(p, self.state[p][name]), values):
            piece.fill_(value)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        stepped = self._stepped()
        for p, _ in stepped:
            self._state(p)["step"] += 1
        if self.phase is OneBitLambPhase.WARMUP:
            for p, group in stepped:
                self._warmup_step(p, group)
            if stepped and int(self.state[stepped[0][0]]["step"]) >= self.freeze_step:
                self._enter_compressed()
        else:
            self._compressed_step(stepped)
        return loss

    def _warmup_step(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        beta1, beta2 = group["betas"]
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if int(state["step"]) == self.freeze_step:
            state["exp_avg_sq_fresh"].copy_(state["exp_avg_sq"])
        update = state["exp_avg"] / state["exp_avg_sq"].sqrt().add_(group["eps"])
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        frozen = self._per_parameter(p, "lamb_coeff_freeze")
        for i, (param, piece) in enumerate(self.segments.views(p, update)):
            ratio = trust_ratio(param, piece, group["min_coeff"], group["max_coeff"])
            if ratio != 1.0:
                frozen[i] = self.coeff_beta * frozen[i] + (1 - self.coeff_beta) * ratio
            self.lamb_coeffs.append(ratio)
            param.add_(piece, alpha=-group["lr"] * ratio)
        self._set_per_parameter(p, "lamb_coeff_freeze", frozen)

    def _enter_compressed(self) -> None:
        if self.data_parallel.rank == 0:
            logger.info("OneBitLamb: %d warmup steps done; the trust ratios are frozen and the momentum is averaged "
                        "1-bit compressed from now on", self.freeze_step)
        self.phase = OneBitLambPhase.COMPRESSED
        self.engine_reduces_gradients = False

    def _compressed_step(self, stepped: list[tuple[torch.Tensor, dict]]) -> None:
        previous = {id(p): self.state[p]["exp_avg"].clone() for p, _ in stepped}
        if "scaling_coeff" not in self.state[stepped[0][0]]:
            self._set_scaling_coeffs(stepped)
        for p, group in stepped:
            state = self.state[p]
            state["exp_avg"].lerp_(self.local_grad(p), 1 - group["betas"][0]).mul_(state["scaling_coeff"])
        self._average_momenta([self.state[p]["exp_avg"] for p, _ in stepped])
        for p, group in stepped:
            state = self.state[p]
            scale = state["scaling_coeff"]  # (0 in a loaded state's padding)
            state["exp_avg"].mul_(torch.where(scale != 0, scale.reciprocal(), 0.0))
            self._frozen_ratio_step(p, group, previous[id(p)])

    def _set_scaling_coeffs(self, stepped: list[tuple[torch.Tensor, dict]]) -> None:
        """Each parameter's momentum RMS against their mean: one compression scale then fits every parameter."""
        rms = {id(p): torch.tensor([float(m.norm()) / m.numel() ** 0.5
                                    for _, m in self.segments.views(p, self.state[p]["exp_avg"])],
                                   dtype=torch.float64) for p, _ in stepped}
        united = float(torch.cat(list(rms.values())).mean())
        for p, _ in stepped:  # (a momentum of all zeros, where DeepSpeed would divide by 0, keeps its scale)
            self.state[p]["scaling_coeff"] = torch.ones_like(p)  # 1 in the padding: it is divided by
            self._set_per_parameter(p, "scaling_coeff", [united / r if r > 0 else 1.0 for r in rms[id(p)].tolist()])

    def _average_momenta(self, momenta: list[torch.Tensor]) -> None:
        """Every parameter's (scaled) momentum, in model order, averaged as one compressed message."""
        if self.data_parallel.world == 1:
            return
        stepped = [p for p, _ in self._stepped()]
        pieces = [m for p, momentum in zip(stepped, momenta) for _, m in self.segments.views(p, momentum)]
        flat = torch.cat(pieces)
        if self._fused is None:
            dp = self.data_parallel
            self._fused = CompressedAverager([(0, flat.numel())], flat.device, dp.group, dp.rank, dp.world,
                                             dp.counter)
        self._fused.average_(flat)
        torch._foreach_copy_(pieces, list(flat.split([m.numel() for m in pieces])))

    def _frozen_ratio_step(self, p: torch.Tensor, group: dict, previous: torch.Tensor) -> None:
        state = self.state[p]
        beta1, beta2 = group["betas"]
        exp_avg, fresh = state["exp_avg"], state["exp_avg_sq_fresh"]
        implied = (exp_avg - previous * beta1) / (1 - beta1)
        fresh.mul_(beta2).addcmul_(implied, implied, value=1 - beta2)
        denominator = state["exp_avg_sq"].sqrt().add_(group["eps"])
        prelim = exp_avg / denominator
        update = prelim + group["weight_decay"] * p if group["weight_decay"] else prelim
        fresh_denominator = fresh.sqrt().add_(group["eps"])
        views = self.segments.views(p, update, prelim, denominator, fresh_denominator)
        last_factors, frozen = self._per_parameter(p, "last_factor"), self._per_parameter(p, "lamb_coeff_freeze")
        for i, (param, piece, prelim_piece, denom, fresh_denom) in enumerate(views):
            factor = float((denom / fresh_denom).max())
            if group["weight_decay"]:
                share = min(1.0, float(prelim_piece.norm() / piece.norm()))
                factor = factor * share + (1.0 - share)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last = last_factors[i]
            factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
            last_factors[i] = factor
            coeff = frozen[i] * factor
            self.lamb_coeffs.append(coeff)
            param.add_(piece, alpha=-group["lr"] * coeff)
        self._set_per_parameter(p, "last_factor", last_factors)

    def reset_errors(self) -> None:
        super().reset_errors()
        self._fused = None

    def restore_phase(self) -> None:
        self._fused = None
        steps = max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)
        warm = steps < self.freeze_step
        self.phase = OneBitLambPhase.WARMUP if warm else OneBitLambPhase.COMPRESSED
        self.engine_reduces_gradients = warm
