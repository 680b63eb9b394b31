"""PyTorch-style backward (Note [tensor backward]): `loss.backward()` then `engine.step()` trains as
`engine.backward(loss)` does and as plain PyTorch does (also through `engine.compat.deepspeed`), with SGD (which,
unlike Adam, shows any error in the gradients' scale) over 2 ranks with 2 accumulation steps under ZeRO 0-3, with
clipping; fp16 goes through `engine.scale(loss)`, and what cannot train right is refused before the first update."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from engine.compat import deepspeed
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    micro_batches,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_reference,
    trained_params,
)

STEPS, GLOBAL_BATCH, ACCUMULATION, LR = 3, 8, 2, 0.5


def sgd_config(stage: int, micro: int, clip: float = 0.0, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ACCUMULATION,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": clip,
            "steps_per_print": 10**6,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def regularized(model, x):
    """A loss term that reaches the parameters without passing through the forward's outputs."""
    params = getattr(model, "module", model).parameters()  # an engine, or the reference model
    return model(x, x) + 1e-3 * sum((p * p).sum() for p in params)


def train_tensor_backward(engine, rank: int, world: int, loss_fn) -> list[float]:
    losses = []
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        step_losses = []
        for x in micro_batches(batch, rank, world, ACCUMULATION):
            loss = loss_fn(engine, x)
            loss.backward()  # no engine.backward
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))
    return losses


def _worker(rank, world, cases):
    results = []
    for stage, clip, loss_name, api in cases:
        loss_fn = regularized if loss_name == "regularized" else (lambda m, x: m(x, x))
        config = sgd_config(stage, GLOBAL_BATCH // world // ACCUMULATION, clip)
        if api == "deepspeed":  # DeepSpeed 0.18.3+'s documented loop, through the compat engine
            engine = deepspeed.initialize(model=tiny_gpt(), config=config)[0]
        else:
            engine = initialize(tiny_gpt(), config)
        losses = train_tensor_backward(engine, rank, world, loss_fn)
        results.append((losses, trained_params(engine)))
        if api == "deepspeed":
            engine.destroy()
        else:
            engine.close()
    return results


CASES = [(0, 0.0, "model", "tiers"), (1, 0.5, "model", "tiers"), (2, 0.0, "regularized", "tiers"),
         (3, 0.5, "model", "tiers"), (1, 0.0, "model", "deepspeed")]


def test_loss_backward_then_step_equals_pytorch_under_zero_0_to_3():
    references = {}
    for stage, clip, loss_name, _api in CASES:
        loss_fn = regularized if loss_name == "regularized" else (lambda m, x: m(x, x))
        model = tiny_gpt()
        losses, _ = train_reference(model, token_batches(STEPS, GLOBAL_BATCH),
                                    lambda ps: torch.optim.SGD(ps, lr=LR), clip=clip, loss_fn=loss_fn)
        references[(stage, clip, loss_name)] = (losses, param_snapshot(model))  # (the same for either api)
    per_rank = run_distributed(_worker, 2, args=(CASES,), timeout_s=240)
    losses_by_rank = [[losses for losses, _ in rank_results] for rank_results in per_rank]
    for i, case in enumerate(CASES):
        ref_losses, ref_params = references[case[:3]]
        mean = [sum(r[i][s] for r in losses_by_rank) / 2 for s in range(STEPS)]  # each rank's half of the batch
        assert_close_relative(mean, ref_losses)
        assert_params_close(per_rank[0][i][1], ref_params)


def _fp16_engine(stage: int = 0):
    cfg = sgd_config(stage, GLOBAL_BATCH // ACCUMULATION, fp16={"enabled": True, "initial_scale_power": 8})
    return initialize(tiny_gpt(), cfg)


def test_fp16_through_engine_scale_equals_engine_backward():
    by_engine, by_tensor = _fp16_engine(), _fp16_engine()
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        for x in micro_batches(batch, 0, 1, ACCUMULATION):
            by_engine.backward(by_engine(x, x))
            by_engine.step()
            by_tensor.scale(by_tensor(x, x)).backward()
            by_tensor.step()
    assert by_tensor.get_loss_scale() == by_engine.get_loss_scale() == 2.0 ** 8
    assert_params_close(trained_params(by_tensor), trained_params(by_engine))


def test_fp16_without_engine_scale_is_refused_before_any_update():
    engine = _fp16_engine()
    before = trained_params(engine)
    x = token_batches(1, GLOBAL_BATCH)[0][:GLOBAL_BATCH // ACCUMULATION]
    with pytest.raises(RuntimeError, match=r"call engine.scale\(loss\).backward\(\), or engine.backward\(loss\)"):
        engine(x, x).backward()
    engine.backward(engine(x, x))  # the failed backward was abandoned: training goes on
    engine.step()
    engine.backward(engine(x, x))
    engine.step()
    after = trained_params(engine)
    assert any(not torch.equal(after[n], before[n]) for n in before)


def test_torch_autograd_grad_is_neither_scaled_nor_a_backward():
    """torch.autograd.grad over an output (a gradient penalty) or over the parameters returns PyTorch's
    gradients, and reduces or counts nothing: the training backward after it is the step's only one."""
    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    engine = initialize(mlp(), sgd_config(0, 2))
    reference = mlp()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    inputs = torch.randn(ACCUMULATION, 2, 4, generator=torch.Generator().manual_seed(3))
    for x in inputs:
        x = x.clone().requires_grad_()
        (penalty,) = torch.autograd.grad(engine(x).sum(), x)
        (expected,) = torch.autograd.grad(reference(x).sum(), x)
        torch.testing.assert_close(penalty, expected)
        by_engine = torch.autograd.grad(engine(x).sum(), list(engine.module.parameters()))
        by_reference = torch.autograd.grad(reference(x).sum(), list(reference.parameters()))
        for got, want in zip(by_engine, by_reference):
            torch.testing.assert_close(got, want)
        engine(x).square().mean().backward()
        engine.step()
        (reference(x).square().mean() / ACCUMULATION).backward()
    opt.step()
    assert_params_close(trained_params(engine), param_snapshot(reference))
