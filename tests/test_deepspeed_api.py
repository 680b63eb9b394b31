"""engine.compat.deepspeed's calls one by one: where the config comes from, zero.Init and GatheredParameters,
checkpointing, the accelerator and comm, the MoE layer, and the refusals that name what to use instead."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from engine.compat import deepspeed
from engine.compat.deepspeed.unsupported import NotInTiers
from engine.config import ConfigError
from engine.moe import MoE
from tests.distributed import run_distributed
from tests.test_deepspeed_compat import ds_config

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
          "steps_per_print": 10**6}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_config_comes_from_where_deepspeed_takes_it(tmp_path):
    """`config`, else `config_params`, else --deepspeed_config; two sources at once are an error, none is one."""
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "Adam"}}')
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=mlp())
    assert engine.train_micro_batch_size_per_gpu() == 3 and loader is None and scheduler is None
    assert optimizer is engine.optimizer
    engine, *_ = deepspeed.initialize(model=mlp(), config_params=CONFIG)
    assert engine.train_micro_batch_size_per_gpu() == 2
    with pytest.raises(ValueError, match="give one of them"):
        deepspeed.initialize(args=args, model=mlp(), config=CONFIG)
    with pytest.raises(ValueError, match="needs a config"):
        deepspeed.initialize(model=mlp())
    with pytest.raises(ConfigError, match="config file not found"):
        deepspeed.initialize(model=mlp(), config=str(tmp_path / "missing.json"))


def test_engine_answers_deepspeed_calls_and_refuses_the_rest(tmp_path):
    engine, *_ = deepspeed.initialize(model=mlp(), config=CONFIG)
    x = torch.randn(2, 4)
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1 and engine.global_samples == 2
    assert engine.get_lr() == [1e-2] and engine.is_gradient_accumulation_boundary()
    assert (engine.local_rank, engine.global_rank, engine.world_size) == (0, 0, 1)
    assert engine.device == torch.device("cpu") and not engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.zero_optimization_stage() == 0 and not engine.dataloader_drop_last()
    with pytest.raises(NotInTiers, match="DeepSpeedEngine.set_data_post_process_func"):
        engine.set_data_post_process_func(None)


def test_module_level_refusals_name_the_call():
    with pytest.raises(NotInTiers, match="deepspeed.init_inference"):
        deepspeed.init_inference  # noqa: B018
    with pytest.raises(NotInTiers, match="mesh_param"):
        deepspeed.initialize(model=mlp(), config=CONFIG, mesh_param=(2, 1))
    with pytest.raises(NotInTiers, match="get_accelerator\\(\\).create_graph"):
        deepspeed.accelerator.get_accelerator().create_graph()
    assert not hasattr(deepspeed, "DeepSpeedTransformerLayer")  # an AttributeError: hasattr answers False


def test_accelerator_comm_and_moe_answer_for_this_machine():
    acc = deepspeed.accelerator.get_accelerator()
    cuda = torch.cuda.is_available()
    assert acc.device_name() == ("cuda" if cuda else "cpu") and acc.is_available()
    assert acc.communication_backend_name() == ("nccl" if cuda else "gloo")
    acc.synchronize()
    assert deepspeed.comm.get_rank is torch.distributed.get_rank
    assert issubclass(deepspeed.moe.layer.MoE, MoE)


def test_checkpointing_recomputes_with_the_same_result():
    """deepspeed.checkpointing.checkpoint: the same output and gradients as the plain call, with dropout."""
    layer = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = torch.randn(3, 4, requires_grad=True)
    deepspeed.checkpointing.configure(None, deepspeed_config=None)
    torch.manual_seed(1)
    out = deepspeed.checkpointing.checkpoint(layer, x)
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    torch.manual_seed(1)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, grad)
    assert deepspeed.checkpointing.is_configured()


def _zero_worker(rank, world):
    with deepspeed.zero.Init(config_dict_or_path=ds_config(3)):
        model = mlp()
    engine, *_ = deepspeed.initialize(model=model, config={**CONFIG, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    weight = engine.module[0].weight
    status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
    marks = [(p.ds_id, tuple(p.ds_shape), p.ds_numel, p.ds_status) for p in engine.module.parameters()]
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        assert weight.ds_status is status.AVAILABLE
        if rank == 0:
            weight.data.fill_(0.5)  # rank 0's change reaches every rank
    assert weight.ds_status is status.NOT_AVAILABLE
    # DeepSpeed-Chat's and OpenRLHF's save: gather what ds_status says is not there, then read it
    fetch = [p for p in engine.module.parameters() if hasattr(p, "ds_id") and p.ds_status == status.NOT_AVAILABLE]
    with deepspeed.zero.GatheredParameters(fetch, enabled=len(fetch) > 0):
        read = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.empty_partition_cache()
    shards = engine.chunked.sharded_params
    assert len(shards) > 0 and all(shards.is_released(i) for i in range(len(shards)))  # nothing left gathered
    return marks, read, engine.full_state_dict()


def test_zero_init_and_gathered_parameters_under_stage_3():
    """A model built under zero.Init starts from the same values as one built plainly; GatheredParameters with
    modifier_rank=0 gives every rank rank 0's change; DeepSpeed's marks (ds_id, ds_shape, ds_numel, ds_status)
    say what is released, so that code gathering by them reads whole values."""
    results = run_distributed(_zero_worker, 2, timeout_s=120)
    status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
    shapes = [tuple(p.shape) for p in mlp().parameters()]
    for marks, read, whole in results:
        assert marks == [(i, s, torch.Size(s).numel(), status.NOT_AVAILABLE) for i, s in enumerate(shapes)]
        assert torch.equal(read["0.weight"], torch.full((8, 4), 0.5))
        torch.testing.assert_close(read["0.bias"], mlp()[0].bias.detach())
        assert all(torch.equal(read[k], whole[k]) for k in read)


def test_was_step_applied_and_the_loader_on_one_process():
    """As DeepSpeed: was_step_applied() is true only after the step() that updated the model; one process still
    samples with a DistributedSampler (seed 0), whose epoch the script may set."""
    data = torch.utils.data.TensorDataset(torch.randn(6, 4), torch.randn(6, 2))
    engine, _, loader, _ = deepspeed.initialize(model=mlp(), training_data=data,
                                                config={**CONFIG, "gradient_accumulation_steps": 2})
    assert isinstance(loader.data_sampler, torch.utils.data.distributed.DistributedSampler)
    loader.data_sampler.set_epoch(3)
    applied = []
    for x, y in loader:
        engine.backward((engine(x) - y).square().mean())
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, True, False]
    expected = torch.utils.data.distributed.DistributedSampler(data, num_replicas=1, rank=0)
    expected.set_epoch(3)
    assert list(loader.data_sampler) == list(expected)
