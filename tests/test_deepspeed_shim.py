"""engine.compat.deepspeed's Python API with DeepSpeed's semantics, one process each: what initialize does with a
client's optimizer and scheduler, backward's options, the engine as the module, and the modules and helpers
scripts import (deepspeed.ops, utils, runtime, accelerator, ...)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from engine.compat import deepspeed
from engine.compat.deepspeed.unsupported import NotInTiers
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


def test_a_scheduler_object_drives_the_client_optimizer_pointed_at_masters():
    """bf16 points the client optimizer's groups at fp32 masters (where DeepSpeed wraps it): the client's StepLR
    still drives it, so the engine's learning rate follows the schedule, without torch's order warning; a client
    scheduler wins over a config `scheduler`."""
    model = mlp()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    config = {**MICRO, "bf16": {"enabled": True},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=client, lr_scheduler=schedule,
                                                           config=config)
    assert optimizer is client and scheduler is schedule and schedule.optimizer is optimizer
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


class HFLike(nn.Module):
    """A model with methods of its own, as Hugging Face models have."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.checkpointing = False
        self.config_class = "tiny"

    def forward(self, x):
        return self.body(x)

    def gradient_checkpointing_enable(self):
        self.checkpointing = True


def test_the_engine_is_an_nn_module_over_the_model_and_passes_the_rest_to_it():
    """As DeepSpeed's engine: an nn.Module whose submodule is `module` (names prefixed `module.`); attributes of
    neither the engine nor the model are refused by name; DeepSpeed's accessors answer."""
    model = HFLike()
    config = {**MICRO, "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    assert isinstance(engine, nn.Module) and engine.module is model
    assert list(engine.parameters()) == list(model.parameters())
    assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n, _ in model.named_parameters()]
    assert set(engine.state_dict()) == {f"module.{k}" for k in model.state_dict()}
    engine.gradient_checkpointing_enable()
    assert model.checkpointing and engine.config_class == "tiny"
    with pytest.raises(NotInTiers, match="DeepSpeedEngine.no_such_thing"):
        engine.no_such_thing  # noqa: B018
    assert not hasattr(engine, "no_such_thing")
    assert engine.config == config and engine.optimizer_name() == "adamw" and not engine.is_compiled
    with pytest.raises(NotInTiers, match="engine.compile"):
        engine.compile()
    engine.eval()
    assert not model.training and not engine.training
    engine.train()
    assert model.training
    assert engine.tput_timer.avg_samples_per_sec() == float("-inf")
    for i, x in enumerate(batches(8)):
        engine.set_gradient_accumulation_boundary(i % 2 == 1)  # as accelerate sets it: agrees with the count
        engine.backward(engine(x).square().mean())
        engine.step()
    assert engine.global_steps == 4 and engine.tput_timer.global_step_count == 4
    assert engine.tput_timer.avg_samples_per_sec() > 0
    with pytest.raises(ValueError, match="gradient_accumulation_steps 2"):
        engine.set_gradient_accumulation_boundary(True)  # at micro-step 0 of 2
    engine.destroy()
    with pytest.raises(NotInTiers, match="after destroy"):
        engine.step()


def test_a_client_optimizer_names_itself():
    model = mlp()
    engine, *_ = deepspeed.initialize(model=model, config=MICRO, optimizer=torch.optim.SGD(model.parameters(), 0.1))
    assert engine.optimizer_name() == "SGD"


def test_save_16bit_model_writes_deepspeeds_file(tmp_path):
    """pytorch_model.bin by default, a torch.save of the 16-bit state dict that torch.load(weights_only=True)
    reads; a .safetensors name writes safetensors; under ZeRO-3 without the gather flag nothing is written and
    False comes back (as DeepSpeed); the consolidated state dict is ZeRO-3's only."""
    from safetensors.torch import load_file

    config = {**MICRO, "bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=mlp(), config=config)
    engine.backward(engine(batches(1)[0]).float().square().mean())
    engine.step()
    expected = {k: v.to(torch.bfloat16) for k, v in engine.full_state_dict().items()}
    assert engine.save_16bit_model(str(tmp_path)) is True
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    assert engine.save_16bit_model(str(tmp_path), "model.safetensors")
    assert all(torch.equal(v, expected[k]) for k, v in load_file(tmp_path / "model.safetensors").items())
    with pytest.raises(ValueError, match="requires ZeRO-3"):
        engine._zero3_consolidated_16bit_state_dict()
    stage3 = {**config, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=mlp(), config=stage3)
    assert engine.save_16bit_model(str(tmp_path / "none")) is False and not (tmp_path / "none").exists()
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    assert all(torch.equal(v, mlp().state_dict()[k].to(torch.bfloat16)) for k, v in consolidated.items())


def test_deepspeeds_adam_classes_are_torchs_adam_with_its_argument_names():
    """adam_w_mode / adamw_mode True is AdamW (decoupled decay), False is Adam's L2 decay; the choice survives the
    engine rebuilding the optimizer over bf16 masters; what torch has no form of is refused."""
    from engine.compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    def trained(make):
        model = mlp()
        opt = make(model.parameters())
        for x in batches(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return dict(model.named_parameters())

    adamw = trained(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))
    adam = trained(lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1))
    assert_params_close(trained(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1)), adamw)
    assert_params_close(trained(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False)), adam)
    assert_params_close(trained(lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=0.1, adamw_mode=False)), adam)
    model = mlp()
    bf16 = {**MICRO, "bf16": {"enabled": True}}
    engine, optimizer, *_ = deepspeed.initialize(model=model, config=bf16, optimizer=FusedAdam(
        model.parameters(), lr=1e-2, weight_decay=0.1, adam_w_mode=False))
    assert isinstance(optimizer, FusedAdam) and optimizer.param_groups[0]["decoupled_weight_decay"] is False
    assert optimizer.param_groups[0]["params"][0] is not next(model.parameters())  # rebuilt over the masters
    with pytest.raises(ValueError, match="bias_correction=False"):
        FusedAdam(mlp().parameters(), bias_correction=False)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DeepSpeedCPUAdam(mlp().parameters(), amsgrad=True)


def test_module_level_helpers_answer_as_deepspeeds(caplog):
    import random

    import numpy as np
    import psutil

    major, minor, patch = map(int, deepspeed.__version__.split("."))
    assert (major, minor) == (0, 19)
    assert deepspeed.get_accelerator is deepspeed.accelerator.get_accelerator
    acc = deepspeed.get_accelerator()
    acc.reset_peak_memory_stats()
    assert acc.memory_reserved() == acc.max_memory_reserved() == 0 or torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert acc.total_memory() == psutil.virtual_memory().total
    config = deepspeed.DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2,
                                        "optimizer": {"type": "AdamW"}, "bf16": {"enabled": True}})
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) \
        == (8, 4, 2)
    assert config.optimizer_name == "adamw" and config.bfloat16_enabled and not config.zero_enabled
    with pytest.raises(NotInTiers, match="DeepSpeedConfig.elasticity_enabled"):
        config.elasticity_enabled  # noqa: B018
    loader = deepspeed.utils.RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]
    deepspeed.runtime.utils.set_random_seed(3)
    drawn = (random.random(), float(np.random.rand()), torch.rand(1).item())
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    assert drawn == (random.random(), float(np.random.rand()), torch.rand(1).item())
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        deepspeed.runtime.utils.see_memory_usage("after init", force=True)
        deepspeed.runtime.utils.see_memory_usage("not forced")
    assert "after init" in caplog.text and "CPU Virtual Memory" in caplog.text and "not forced" not in caplog.text
    assert deepspeed.runtime.engine.DeepSpeedEngine is deepspeed.DeepSpeedEngine
    from engine.lr_schedules import WarmupLR

    assert deepspeed.runtime.lr_schedules.WarmupLR is WarmupLR
    with pytest.raises(NotInTiers, match="lr_schedules.LRRangeTest"):
        deepspeed.runtime.lr_schedules.LRRangeTest  # noqa: B018
    offload = deepspeed.runtime.zero.offload_config
    assert offload.OffloadDeviceEnum("cpu") is offload.OffloadDeviceEnum.cpu
    assert offload.OffloadStateTypeEnum.optim_states == "optim_states"
    assert deepspeed.comm.has_all_gather_into_tensor() and deepspeed.comm.has_reduce_scatter_tensor()
    assert deepspeed.PipelineModule is deepspeed.pipe.PipelineModule
    with pytest.raises(NotInTiers, match="safe_set_full_fp32_param"):
        deepspeed.utils.safe_set_full_fp32_param  # noqa: B018


def test_safe_get_full_fp32_param_reads_the_master():
    """Under bf16 the parameter is 16-bit and its fp32 master is what the optimizer updates: that is returned."""
    config = {**MICRO, "bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    model = mlp()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.backward(engine(batches(1)[0]).float().square().mean())
    engine.step()
    weight = model[0].weight
    master = deepspeed.utils.safe_get_full_fp32_param(weight)
    assert weight.dtype == torch.bfloat16 and master.dtype == torch.float32
    assert torch.equal(master, engine.full_state_dict()["0.weight"]) and not torch.equal(master, weight.float())
    assert deepspeed.utils.safe_get_full_fp32_param(nn.Parameter(torch.ones(2))) is None


def test_moe_parameters_split_into_their_own_groups_and_train_the_same():
    """DeepSpeed's MoE recipe: the expert parameters move to a group of their own (with the group's options,
    `moe: True`); the engine trains the split groups as the unsplit ones."""
    from engine.compat.deepspeed.moe.layer import MoE
    from engine.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    def model():
        torch.manual_seed(0)
        return MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2, k=1)

    m = model()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(m.parameters()),
                                                                   "name": "parameters", "weight_decay": 0.1})
    assert [g["name"] for g in groups] == ["parameters", "ep_size_1"] and groups[1]["moe"]
    assert groups[1]["weight_decay"] == 0.1 and groups[1]["params"] == list(m.experts.parameters())
    unsplit = model()
    trained = []
    for net, given in ((m, groups), (unsplit, [{"params": list(unsplit.parameters()), "weight_decay": 0.1}])):
        config = {**MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=given)
        for x in batches(2):
            engine.backward(engine(x)[0].square().mean())
            engine.step()
        trained.append(engine.full_state_dict())
    assert_params_close(*trained)


def test_the_rng_tracker_keeps_named_streams_apart():
    """model_parallel_cuda_manual_seed(s): the default stream is seeded with s, the model-parallel one with
    s + 2718; drawing inside fork() leaves the default stream where it was."""
    checkpointing = deepspeed.checkpointing
    checkpointing.model_parallel_cuda_manual_seed(5)
    tracker = checkpointing.get_cuda_rng_tracker()
    first = torch.rand(3)
    with tracker.fork():
        forked = torch.rand(3)
    after = torch.rand(3)
    with tracker.fork():
        forked_again = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(first, torch.rand(3)) and torch.equal(after, torch.rand(3))
    torch.manual_seed(5 + 2718)
    assert torch.equal(forked, torch.rand(3)) and torch.equal(forked_again, torch.rand(3))
    with pytest.raises(Exception, match="seed 2723 already exists"):
        tracker.add("other", 5 + 2718)
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("nope"):
            pass


class DataParallelMPU:
    """A Megatron-style mpu of one process with no model parallelism (DeepSpeed's tests build such ones)."""

    def __init__(self, model_parallel: int = 1):
        self.model_parallel = model_parallel

    def get_model_parallel_world_size(self):
        return self.model_parallel

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0


def test_mpu_offload_states_and_reload_states_where_they_mean_what_deepspeed_means(caplog):
    """An mpu whose groups are Tiers' (no model parallelism) is accepted, another refused naming its sizes;
    offload_states / reload_states on a CPU engine leave training as it was (the states are in host memory)."""
    config = {**MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        engine, *_ = deepspeed.initialize(model=mlp(), config=config, mpu=DataParallelMPU())
    assert "the mpu's groups are Tiers' own" in caplog.text
    with pytest.raises(NotInTiers, match="model-parallel size 2"):
        deepspeed.initialize(model=mlp(), config=config, mpu=DataParallelMPU(model_parallel=2))
    reference = mlp()
    for x in batches(2):
        engine.backward(engine(x).square().mean())
        engine.offload_states(include=["optim_states", "lp_params"])
        engine.reload_states()
        engine.step()
        reference(x).square().mean().backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    assert_params_close(dict(engine.module.named_parameters()), dict(reference.named_parameters()))
    with pytest.raises(ValueError, match="nvme"):
        engine.offload_states(device="nvme")
    with pytest.raises(ValueError, match="gradients"):
        engine.offload_states(include=["gradients"])


def test_zero_grad_and_load_state_dict_act_where_the_engine_keeps_gradients_and_weights():
    """zero_grad() clears the gradient chunks (a parameter that gets no new gradient trains on none); under bf16
    load_state_dict() moves the fp32 masters too, so the next update starts from the loaded weights."""
    config = {**MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model = mlp()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    x = batches(1)[0]
    engine.backward(engine(x).square().mean())  # accumulation 1: a stray gradient, never stepped
    engine.zero_grad()
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.backward(torch.zeros((), requires_grad=True))  # no gradient reaches any parameter; the step runs
    engine.step()
    assert all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
    bf16 = {**config, "bf16": {"enabled": True}}
    engine, *_ = deepspeed.initialize(model=mlp(), config=bf16)
    torch.manual_seed(7)
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine.load_state_dict({f"module.{k}": v for k, v in other.state_dict().items()})
    rounded = {k: v.to(torch.bfloat16).float() for k, v in other.state_dict().items()}
    assert all(torch.equal(v, rounded[k]) for k, v in engine.full_state_dict().items())  # the masters
    wrong = {f"module.{k}": v for k, v in mlp().state_dict().items()}
    wrong["module.2.weight"] = torch.zeros(3, 8)  # a shape mismatch after loadable tensors: nothing is loaded
    with pytest.raises(RuntimeError, match="nothing was loaded; size mismatch"):
        engine.load_state_dict(wrong)
    assert all(torch.equal(v, rounded[k]) for k, v in engine.full_state_dict().items())


def _full_state_worker(rank, world):
    """On 2 ranks, each with its own batch: the full gradient before step() and the full Adam states after it,
    ZeRO 0 with a client optimizer and ZeRO 1-3 (states, then gradients, then parameters sharded) with the
    config's, against one process's torch AdamW on the mean loss."""
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    reference = mlp()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    (sum(reference(x).square().mean() for x in xs) / world).backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    ref_opt.step()
    ref_states = {n: ref_opt.state[p] for n, p in reference.named_parameters()}
    seen = {}
    for stage in (0, 1, 2, 3):
        model = mlp()
        config = {**MICRO, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        client = torch.optim.AdamW(model.parameters(), lr=1e-2) if stage == 0 else None
        if client is None:
            config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
        engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=client)
        engine.backward(engine(xs[rank]).square().mean())
        grads = {n: deepspeed.utils.safe_get_full_grad(p) for n, p in model.named_parameters()}
        engine.step()
        states = {n: {k: deepspeed.utils.safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
                  for n, p in model.named_parameters()}
        seen[stage] = (grads, states)
    return ref_grads, ref_states, seen


def test_full_gradients_and_optimizer_states_are_the_averaged_ones():
    from tests.distributed import run_distributed

    for ref_grads, ref_states, seen in run_distributed(_full_state_worker, 2, timeout_s=120):
        for grads, states in seen.values():
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7)
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(states[name][key], ref_states[name][key], rtol=1e-5, atol=1e-9)
