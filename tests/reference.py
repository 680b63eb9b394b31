"""The reference every strategy is held to: plain single-process PyTorch on the same model, data and seed."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.models import gpt_from_preset

FP32_RTOL = 1e-5


def tiny_gpt(seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    return gpt_from_preset("tiny", **overrides)


def token_batches(steps: int, global_batch: int, seq: int = 32, vocab: int = 256, seed: int = 1) -> list[torch.Tensor]:
    """One [global_batch, seq] tensor of token ids per optimizer step."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq), generator=g) for _ in range(steps)]


def micro_batches(batch: torch.Tensor, rank: int, world: int, accumulation: int) -> list[torch.Tensor]:
    """This rank's rows of a global batch, split into `accumulation` micro-batches."""
    rows = batch.shape[0] // world
    mine = batch[rank * rows:(rank + 1) * rows]
    return list(mine.chunk(accumulation))


def train_reference(
    model: nn.Module,
    batches: list[torch.Tensor],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    clip: float = 0.0,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[float], list[float]]:
    """Full-batch steps; returns (losses, pre-clip gradient norms)."""
    loss_fn = loss_fn or (lambda m, x: m(x, x))
    opt = make_optimizer(list(model.parameters()))
    losses, norms = [], []
    for x in batches:
        loss = loss_fn(model, x)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def train_reference_mixed(
    model: nn.Module,
    batches: list[torch.Tensor],
    dtype: torch.dtype,
    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    clip: float = 0.0,
    loss_scale: float = 1.0,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch mixed precision as DeepSpeed's bf16 / fp16 modes run it: the model in `dtype` (under
    autocast), fp32 master weights stepped from the widened, unscaled gradients, rounded back after each
    step. Returns (losses, the model's `dtype` parameters by name, the fp32 masters by the same names)."""
    loss_fn = loss_fn or (lambda m, x: m(x, x))
    model.to(dtype)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = make_optimizer(masters)
    losses = []
    for x in batches:
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model, x)
        (loss.float() * loss_scale).backward()
        step_masters(masters, params, opt, clip, loss_scale)
        losses.append(loss.item())
    names = [n for n, _ in model.named_parameters()]
    return losses, param_snapshot(model), {n: m.detach().clone() for n, m in zip(names, masters)}


def step_masters(masters: list[torch.Tensor], params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                 clip: float = 0.0, loss_scale: float = 1.0) -> None:
    """One mixed-precision update as DeepSpeed's bf16 / fp16 modes make it: the 16-bit `params`' gradients, widened
    and unscaled, onto their fp32 `masters`, clipped (0: not), stepped, and rounded back into `params`."""
    for m, p in zip(masters, params):
        m.grad, p.grad = p.grad.float() / loss_scale, None
    torch.nn.utils.clip_grad_norm_(masters, clip if clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for m, p in zip(masters, params):
            p.copy_(m)


def train_engine(engine, batches: list[torch.Tensor], rank: int, world: int, accumulation: int,
                 loss_fn: Callable | None = None) -> tuple[list[float], list[float]]:
    """The engine's loop over the same global batches; returns (this rank's losses, grad norms)."""
    loss_fn = loss_fn or (lambda e, x: e(x, x))
    losses, norms = [], []
    for x in batches:
        step_losses = []
        for micro in micro_batches(x, rank, world, accumulation):
            loss = loss_fn(engine, micro)
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def assert_close_relative(actual: list[float], expected: list[float], rtol: float = FP32_RTOL) -> None:
    assert len(actual) == len(expected), (actual, expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rtol * abs(e), \
            f"step {i}: {a} vs reference {e} (relative {abs(a - e) / abs(e):.2e} > {rtol})"


def assert_params_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                        rtol: float = FP32_RTOL, atol: float | None = None) -> None:
    """Each parameter within rtol of the reference, elementwise, with an absolute floor (default rtol / 10) for
    the elements near zero."""
    assert actual.keys() == expected.keys()
    atol = rtol * 0.1 if atol is None else atol
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def param_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def trained_params(engine) -> dict[str, torch.Tensor]:
    """The engine's parameters by name as `param_snapshot` names them, whole (gathered under ZeRO-3;
    every rank must call this)."""
    full = engine.full_state_dict()
    return {n: full[n] for n, _ in engine.module.named_parameters()}
