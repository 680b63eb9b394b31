"""Adam without bias correction and LAMB (DeepSpeed FusedLamb's semantics) through the engine, against hand-written
updates of the formulas on the same model, data and seed."""

from __future__ import annotations

import math

import pytest
import torch

from engine import initialize
from engine.config import load_config
from engine.config_schema import ConfigError
from engine.optimizers.lamb import Lamb
from tests.reference import assert_params_close, param_snapshot, tiny_gpt, token_batches, trained_params

STEPS = 4
BETAS = (0.9, 0.95)


def _config(optimizer: dict, stage: int = 0, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "optimizer": optimizer,
            "zero_optimization": {"stage": stage, **zero}, "steps_per_print": 10**6}


class _ReferenceAdam:
    """m, v as they are (no 1 - beta^t): p -= lr * m / (sqrt(v) + eps), weight decay decoupled or as L2."""

    def __init__(self, params, lr, eps, wd, decoupled):
        self.params, self.lr, self.eps, self.wd, self.decoupled = params, lr, eps, wd, decoupled
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self):
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad.clone()
            if self.decoupled:
                p -= self.lr * self.wd * p
            else:
                g += self.wd * p
            m.copy_(BETAS[0] * m + (1 - BETAS[0]) * g)
            v.copy_(BETAS[1] * v + (1 - BETAS[1]) * g * g)
            p -= self.lr * m / (torch.sqrt(v) + self.eps)


class ReferenceLamb:
    """FusedLamb's per-parameter formula: u = m / (sqrt(v) + eps) + wd p; ratio = clamp(|p| / |u|);
    p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * ratio * u (p -= lr * ratio * u without bias correction)."""

    def __init__(self, params, lr, eps, wd, max_coeff, min_coeff, bias_correction=True, betas=BETAS):
        self.params, self.lr, self.eps, self.wd = params, lr, eps, wd
        self.bias_correction, self.betas = bias_correction, betas
        self.max_coeff, self.min_coeff, self.t = max_coeff, min_coeff, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.ratios: list[float] = []

    @torch.no_grad()
    def step(self):
        self.t += 1
        beta1, beta2 = self.betas
        size = self.lr * math.sqrt(1 - beta2 ** self.t) / (1 - beta1 ** self.t) if self.bias_correction else self.lr
        self.ratios = []
        for p, m, v in zip(self.params, self.m, self.v):
            m.copy_(beta1 * m + (1 - beta1) * p.grad)
            v.copy_(beta2 * v + (1 - beta2) * p.grad * p.grad)
            u = m / (torch.sqrt(v) + self.eps) + self.wd * p
            w_norm, u_norm = torch.linalg.vector_norm(p).item(), torch.linalg.vector_norm(u).item()
            ratio = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, self.min_coeff), self.max_coeff)
            self.ratios.append(ratio)
            p -= size * ratio * u


def _train_both(optimizer: dict, make_reference):
    batches = token_batches(STEPS, 4)
    engine = initialize(tiny_gpt(), _config(optimizer))
    assert len(engine.chunked.states) == 1  # every parameter in one chunk: per-parameter norms must split it
    for x in batches:
        engine.backward(engine(x, x))
        engine.step()
    model = tiny_gpt()
    reference = make_reference([p for p in model.parameters()])
    for x in batches:
        model(x, x).backward()
        reference.step()
        model.zero_grad()
    return engine, trained_params(engine), param_snapshot(model), reference


@pytest.mark.parametrize("kind, decoupled", [("AdamW", True), ("Adam", False)])
def test_adam_without_bias_correction_equals_the_formula(kind, decoupled):
    params = {"lr": 1e-3, "betas": list(BETAS), "eps": 1e-6, "weight_decay": 0.1, "bias_correction": False}
    if kind == "Adam":
        params["adam_w_mode"] = False
    _, got, want, _ = _train_both({"type": kind, "params": params},
                                  lambda ps: _ReferenceAdam(ps, 1e-3, 1e-6, 0.1, decoupled))
    assert_params_close(got, want)
    with_correction = initialize(tiny_gpt(), _config({"type": kind, "params": {**params, "bias_correction": True}}))
    assert type(with_correction.optimizer).__name__ != "UncorrectedAdam"


def test_lamb_takes_the_trust_ratio_per_parameter_and_clamps_it():
    # max_coeff 2.2 is below |p| / |u| for the larger matrices, min_coeff 0.5 above it for the small biases
    params = {"lr": 2e-2, "betas": list(BETAS), "eps": 1e-6, "weight_decay": 0.01, "max_coeff": 2.2,
              "min_coeff": 0.5}
    engine, got, want, reference = _train_both({"type": "Lamb", "params": params},
                                               lambda ps: ReferenceLamb(ps, 2e-2, 1e-6, 0.01, 2.2, 0.5))
    assert_params_close(got, want)
    ratios = engine.optimizer.get_lamb_coeffs()
    assert ratios == pytest.approx(reference.ratios, rel=1e-4)
    assert 2.2 in ratios and 0.5 in ratios and any(0.5 < r < 2.2 for r in ratios)  # both clamps and the ratio


def test_lamb_without_bias_correction_steps_by_lr():
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = Lamb([p], lr=0.1, bias_correction=False, betas=(0.5, 0.5), eps=0.0, max_coeff=100.0)
    p.grad = torch.tensor([1.0, 1.0])
    opt.step()
    # m = 0.5 g, v = 0.5 g², u = m / sqrt(v) = sqrt(0.5) per element, |u| = 1, |p| = 5: p -= 0.1 * 5 * u
    torch.testing.assert_close(p.detach(), torch.tensor([3.0, 4.0]) - 0.5 * math.sqrt(0.5))
    assert opt.get_lamb_coeffs() == [pytest.approx(5.0)]


def test_lamb_params_and_layouts_it_refuses():
    loaded = load_config({"optimizer": {"type": "lamb", "params": {"max_coeff": 5.0, "bias_correction": False}}})
    assert loaded.optimizer.type == "Lamb" and loaded.optimizer.params["min_coeff"] == 0.01
    refused = [({"max_grad_norm": 1.0}, "gradient_clipping"), ({"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff"),
               ({"max_coef": 1.0}, "max_coef")]
    for params, words in refused:
        with pytest.raises(ConfigError, match=words):
            load_config({"optimizer": {"type": "Lamb", "params": params}})
    offloaded = _config({"type": "Lamb"}, offload_optimizer={"device": "cpu"})
    with pytest.raises(ConfigError, match="offloaded in pieces"):
        initialize(tiny_gpt(), offloaded)
