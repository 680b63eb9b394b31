"""engine.compat.deepspeed's Python API with DeepSpeed's semantics, one process each: what initialize does with a
client's optimizer and scheduler, backward's options, the engine as the module, and the modules and helpers
scripts import (deepspeed.ops, utils, runtime, accelerator, ...)."""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from engine.compat import deepspeed
from tests.reference import assert_params_close

MICRO = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, generator=g) for _ in range(n)]


def test_a_client_optimizer_wins_over_the_config_and_model_parameters(caplog):
    """DeepSpeed's GAN example passes all three: the client's optimizer trains, the others are logged as unused;
    a callable optimizer is called with model_parameters."""
    model = mlp()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {**MICRO, "optimizer": {"type": "Adam", "params": {"lr": 1.0}}}
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config,
                                                       model_parameters=model.parameters())
    assert optimizer is client and engine.get_lr() == [0.1]
    assert "`optimizer` section is not used" in caplog.text and "model_parameters are not used" in caplog.text
    reference = mlp()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x in batches(2):
        engine.backward(engine(x).square().mean())
        engine.step()
        reference(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_close(dict(engine.module.named_parameters()), dict(reference.named_parameters()))
    model = mlp()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=MICRO, model_parameters=[model[0].weight],
                                                   optimizer=lambda params: torch.optim.SGD(params, lr=0.3))
    assert optimizer.param_groups[0]["params"] == [model[0].weight] and engine.get_lr() == [0.3]


def test_a_scheduler_object_drives_the_optimizer_the_engine_rebuilt():
    """bf16 rebuilds the client optimizer over fp32 masters (where DeepSpeed wraps it): the client's StepLR is
    re-pointed at it, so the engine's learning rate follows the schedule, without torch's order warning; a
    client scheduler wins over a config `scheduler`."""
    model = mlp()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    config = {**MICRO, "bf16": {"enabled": True},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=client, lr_scheduler=schedule,
                                                           config=config)
    assert optimizer is not client and scheduler is schedule and schedule.optimizer is optimizer
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in batches(3):
            engine.backward(engine(x).float().square().mean())
            engine.step()
            seen.append(engine.get_lr())
    assert seen == [[0.05], [0.025], [0.0125]] and schedule.get_last_lr() == [0.0125]


def test_backward_without_scaling_by_the_accumulation_steps_sums_the_micro_batches():
    """scale_wrt_gas=False: with SGD and 2 accumulation steps the update is lr times the sum of the two
    micro-batches' gradients (the default averages them)."""
    config = {**MICRO, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    for scale_wrt_gas, divisor in ((False, 1.0), (True, 2.0)):
        engine, *_ = deepspeed.initialize(model=mlp(), config=config)
        reference = mlp()
        for x in batches(2):
            engine.backward(engine(x).square().mean(), scale_wrt_gas=scale_wrt_gas)
            engine.step()
            (reference(x).square().mean() / divisor).backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
        assert_params_close(dict(engine.module.named_parameters()), dict(reference.named_parameters()))
