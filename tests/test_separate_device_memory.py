"""The CUDA code path of offload on the CPU seam (Note [separate device memory]): with the device's memory its
own, the device tier is a bounded cache — offloaded kinds hold no device bytes between steps, offloaded optimizer
states are stepped on the host with the 16-bit gradient going down and the 16-bit parameter coming up — and
training equals the same run without offload (fp32, bf16, fp16), and plain PyTorch directly in fp32."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from offload.chunk import Location
from offload.device_memory import SEPARATE_ENV
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import adamw
from tests.test_mixed_precision import precision_config
from tests.test_zero import GLOBAL_BATCH, zero_config

STEPS = 3
OFFLOADED_KINDS = ("optim", "master", "grad")


def _config(stage: int, dtype: torch.dtype, home: str, param_home: str | None, nvme_dir: str, world: int) -> dict:
    micro = GLOBAL_BATCH // world
    cfg = zero_config(stage, micro, 1) if dtype == torch.float32 else precision_config(stage, dtype, micro, 1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": home, "nvme_path": nvme_dir}
    if param_home is not None:
        cfg["zero_optimization"]["offload_param"] = {"device": param_home, "nvme_path": nvme_dir}
    cfg["zero_optimization"].pop("chunk_size", None)  # the padding-minimizing layout: bus bytes are per parameter
    cfg["aio"] = {"block_size": 4096}
    return cfg


def _train(rank: int, world: int, cfg: dict, separate: bool):
    """Trains STEPS steps; returns (losses, params, device bytes by kind after each step, bus bytes, the device
    tier's peak). `separate`: what the environment (SEPARATE_ENV) is expected to make of the device's memory."""
    engine = initialize(tiny_gpt(seed=rank), cfg)
    manager = getattr(engine.optimizer, "manager", None)  # None: nothing offloaded
    assert manager is None or manager.memory.separate is separate
    losses, between = [], []
    rows = GLOBAL_BATCH // world
    for x in token_batches(STEPS, GLOBAL_BATCH):
        mine = x[rank * rows:(rank + 1) * rows]
        loss = engine(mine, mine)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        between.append(engine.device_state_bytes())
    bus, device_peak = 0, 0
    if manager is not None:
        stats = manager.stats
        bus = manager.memory.bus.total + stats.moved_bytes["cpu->device"] + stats.moved_bytes["device->cpu"]
        device_peak = stats.peak_bytes.get("device", 0)
    params = trained_params(engine)
    engine.close()
    return losses, params, between, bus, device_peak


def _without_offload(cfg: dict) -> dict:
    zero = {k: v for k, v in cfg["zero_optimization"].items() if k not in ("offload_optimizer", "offload_param")}
    return {**cfg, "zero_optimization": zero}


def _worker(rank, world, cfg, separate):
    return _train(rank, world, cfg, separate)


# bus bytes per parameter per step: ZeRO-2 bf16, the gradient shard down (2) and the parameter shard up (2);
# ZeRO-3 with parameters on the host, the shard up for forward and again for backward (2 + 2), the gradient down (2)
# (+ chunks the tiny model gathers twice); fp32 ZeRO-1 without masters: the gradient (4) and the parameter (4) down,
# the parameter up (4)
@pytest.mark.parametrize("stage,dtype,home,param_home,bus", [
    (2, torch.bfloat16, "cpu", None, (4.0, 4.5)), (3, torch.bfloat16, "cpu", "cpu", (6.0, 7.0)),
    (1, torch.float32, "cpu", None, (12.0, 12.5)), (3, torch.float16, "nvme", "nvme", (6.0, 7.0))])
def test_offloaded_states_leave_the_device_and_training_equals_the_host_run(tmp_path, monkeypatch, stage, dtype,
                                                                           home, param_home, bus):
    monkeypatch.delenv(SEPARATE_ENV, raising=False)
    cfg = _config(stage, dtype, home, param_home, str(tmp_path), 1)
    expected = _train(0, 1, _without_offload(cfg), separate=False)  # the same run, nothing offloaded
    monkeypatch.setenv(SEPARATE_ENV, "1")
    losses, params, between, moved, device_peak = _train(0, 1, cfg, separate=True)
    assert_close_relative(losses, expected[0])
    assert_params_close(params, expected[1])  # (the fp32 masters, under bf16 / fp16)
    psi = sum(p.numel() for p in params.values())
    offloaded = OFFLOADED_KINDS if stage >= 2 else ("optim", "master")  # stage 1 keeps whole gradients
    for held in between:
        assert all(held[kind] == 0 for kind in offloaded), held  # nothing offloaded stays on the device
        # stages 0-2 keep whole 16-bit parameters on the device; stage 3 with offload_param none of them
        assert held["param"] == (0 if param_home else between[0]["param"]) and (param_home or held["param"] > 0)
    assert device_peak == 0  # no device budget: the manager's device tier is never used
    per_param = moved / psi / STEPS  # padding included
    assert bus[0] <= per_param <= bus[1], per_param


def test_fp32_offload_on_the_seam_equals_pytorch(tmp_path, monkeypatch):
    """fp32, stage 1 and 2 on 2 ranks: the parameters stepped on the host (down, stepped, up) equal plain PyTorch."""
    model = tiny_gpt()
    ref_losses, _ = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0)
    ref_params = param_snapshot(model)
    monkeypatch.setenv(SEPARATE_ENV, "1")
    for stage in (1, 2):
        cfg = _config(stage, torch.float32, "cpu", None, str(tmp_path), 2)
        results = run_distributed(_worker, 2, args=(cfg, True))
        offloaded = OFFLOADED_KINDS if stage >= 2 else ("optim", "master")
        for _, params, between, _, _ in results:
            assert all(held[k] == 0 for held in between for k in offloaded)
            assert_params_close(params, ref_params)
        assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)


def test_ratio_keeps_its_share_of_the_states_on_the_device(tmp_path, monkeypatch):
    """DeepSpeed's offload_optimizer.ratio: the share of optimizer states offloaded and stepped on the host; the rest
    lives (and is stepped) on the device, and training is unchanged."""
    monkeypatch.delenv(SEPARATE_ENV, raising=False)
    cfg = _config(3, torch.bfloat16, "cpu", None, str(tmp_path), 1)
    cfg["zero_optimization"]["chunk_size"] = 10_000  # a dozen chunks: the share is counted in whole chunks
    expected = _train(0, 1, cfg, separate=False)
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.4
    monkeypatch.setenv(SEPARATE_ENV, "1")
    engine = initialize(tiny_gpt(), cfg)
    for x in token_batches(STEPS, GLOBAL_BATCH):
        engine.backward(engine(x, x))
        engine.step()
    manager = engine.optimizer.manager
    states = manager.chunks_of("optim")
    on_device = sum(manager.chunk(c).numel for c in states if manager.chunk(c).location is Location.DEVICE)
    total = sum(manager.chunk(c).numel for c in states)
    assert 0.45 <= on_device / total <= 0.6  # (1 - ratio) of the elements, to a chunk
    held = engine.device_state_bytes()
    assert held["optim"] == on_device * 4 and held["master"] > 0  # the device share's masters stay beside them
    assert_params_close(trained_params(engine), expected[1])
    engine.close()


def test_ratio_below_one_needs_stage_3():
    from engine.config import ConfigError
    cfg = _config(2, torch.float32, "cpu", None, "", 1)
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    with pytest.raises(ConfigError, match="needs ZeRO stage 3"):
        initialize(tiny_gpt(), cfg)


def test_initialize_stays_within_a_device_budget_a_third_of_the_model(tmp_path, monkeypatch):
    """Note [a bounded start]: with parameters and optimizer states offloaded, no chunk payload, shard, master or
    gradient buffer is made for the whole model on the device at once: initialize's device peak (sampled where a
    chunk is full) stays within a budget a third of the model's 16-bit weights, and training then equals the run
    where the device is the host."""
    monkeypatch.delenv(SEPARATE_ENV, raising=False)
    cfg = _config(3, torch.bfloat16, "cpu", "cpu", str(tmp_path), 1)
    cfg["zero_optimization"]["chunk_size"] = 10_000
    expected = _train(0, 1, cfg, separate=False)
    psi = sum(p.numel() for p in tiny_gpt().parameters())
    budget = 2 * psi // 3  # a third of the 16-bit weights
    cfg["memory"] = {"device_budget": budget}
    monkeypatch.setenv(SEPARATE_ENV, "1")
    engine = initialize(tiny_gpt(), cfg)
    memory = engine.optimizer.manager.memory
    assert 0 < memory.sampled_peak <= budget, (memory.sampled_peak, budget)
    engine.close()
    losses, params, between, _, device_peak = _train(0, 1, cfg, separate=True)
    assert_close_relative(losses, expected[0])
    assert_params_close(params, expected[1])
    assert 0 < device_peak <= budget


def test_offload_param_keeps_the_sharded_parameters_on_the_host_until_they_are_chunked():
    """Note [a bounded start]: initialize moves the model to the device but for the trainable parameters offload_param
    shards (the rest of the model, buffers and the parameters below the persistence threshold, go)."""
    from engine.config import load_config
    from engine.initialization import _homed_on_host, _to_device
    from engine.mesh import Mesh
    from engine.plan import RunPlan
    mesh = Mesh.single("cpu")
    raw = _config(3, torch.bfloat16, "cpu", "cpu", "", 1)
    raw["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    model = tiny_gpt()
    cfg = load_config(raw)
    keep = _homed_on_host(model, cfg, RunPlan.of(cfg, mesh).chunks, rebuilt=False)
    big = {id(p) for p in model.parameters() if p.numel() >= 100}
    assert keep == big and 0 < len(big) < len(list(model.parameters()))
    _to_device(model, torch.device("meta"), keep)  # meta stands in for the device: the kept ones stay where they are
    for p in model.parameters():
        assert p.device.type == ("cpu" if id(p) in keep else "meta")
    without = load_config(_config(3, torch.bfloat16, "cpu", None, "", 1))
    assert _homed_on_host(tiny_gpt(), without, RunPlan.of(without, mesh).chunks, rebuilt=False) == set()
