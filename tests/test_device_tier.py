"""The device tier from the config (Note [device tier]): `memory.device_budget` and `placement: "auto"` make the
chunk manager's device tier a budgeted cache above the homes. On this CPU-only machine the device tier is RAM,
accounted apart, so the budgets are real: training equals plain PyTorch, the device tier never holds more than
its budget, chunks page in and out of it, and a budget below the working set says what to set."""

from __future__ import annotations

import pytest

from engine import initialize
from engine.config import ConfigError
from offload.chunk import Location
from offload.manager import BudgetError
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_engine,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import adamw
from tests.test_zero import GLOBAL_BATCH, STEPS, zero_config

CHUNK = 20_000  # elements per chunk: 80 kB in fp32


@pytest.fixture(scope="module")
def reference():
    model = tiny_gpt()
    losses, norms = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0)
    return losses, norms, param_snapshot(model)


def device_config(stage: int, home: str, nvme_dir: str, **memory) -> dict:
    cfg = zero_config(stage, GLOBAL_BATCH // 2, 2, chunk_size=CHUNK)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": home, "nvme_path": nvme_dir}
    if stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": home, "nvme_path": nvme_dir}
    cfg["aio"] = {"block_size": 4096}
    cfg["memory"] = memory
    return cfg


@pytest.mark.parametrize("stage,home,placement", [(3, "cpu", "static"), (3, "nvme", "static"), (2, "cpu", "auto"),
                                                  (3, "nvme", "auto")])
def test_a_device_budget_caps_the_device_tier_and_training_equals_pytorch(reference, tmp_path, stage, home,
                                                                          placement):
    ref_losses, ref_norms, ref_params = reference
    budget = 12 * CHUNK * 4  # a dozen chunks' worth: the step's working set fits, the model's states do not
    cfg = device_config(stage, home, str(tmp_path), device_budget=budget)
    cfg["zero_optimization"]["placement"] = placement
    engine = initialize(tiny_gpt(), cfg)
    losses, norms = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), 0, 1, 2)
    manager = engine.optimizer.manager
    stats = manager.stats
    assert_close_relative(losses, ref_losses)
    assert_close_relative(norms, ref_norms)
    assert_params_close(trained_params(engine), ref_params)
    assert 0 < stats.peak_bytes["device"] <= budget  # used, and never above the budget
    held = sum(stats.resident_bytes.values())
    assert held > budget  # the states are larger than the budget: a share of them fits on the device
    if placement == "auto":  # the budget follows the capacity minus the traced non-chunk memory, too
        assert manager.device_capacity is not None and manager.tracer.trace is not None
    # a share of the states lives (and is stepped) on the device, the rest on the host (Note [where a chunk is
    # used]): the device tier holds optimizer states between steps, within the budget, and not all of them
    tiers = [manager.chunk(c).location for _, _, c, _ in engine.optimizer._items]
    assert Location.DEVICE in tiers and any(t is not Location.DEVICE for t in tiers)
    assert 0 < engine.device_state_bytes()["optim"] <= budget
    engine.close()


def test_a_device_budget_no_chunk_fits_in_names_the_value_to_set(tmp_path):
    cfg = device_config(3, "cpu", str(tmp_path), device_budget=CHUNK * 4 // 2)  # half a chunk: no chunk fits
    with pytest.raises(BudgetError) as error:  # at start-up: the device tier would never be used
        initialize(tiny_gpt(), cfg)
    message = str(error.value)
    assert "a device budget of 39.1 KiB holds no chunk on the device tier" in message
    assert "set memory.device_budget to at least" in message


@pytest.mark.parametrize("memory,zero", [({"device_budget": "1MB"}, {}), ({}, {"placement": "auto"})])
def test_the_device_tier_needs_something_offloaded(memory, zero):
    cfg = zero_config(3, 4, 1)
    cfg["memory"] = memory
    cfg["zero_optimization"].update(zero)
    with pytest.raises(ConfigError, match="nothing is offloaded; set zero_optimization.offload_optimizer.device"):
        initialize(tiny_gpt(), cfg)


def test_a_device_margin_needs_placement_auto():
    cfg = zero_config(3, 4, 1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg["memory"] = {"device_margin": "1GB"}
    with pytest.raises(ConfigError, match="memory.device_margin.*set zero_optimization.placement to \"auto\""):
        initialize(tiny_gpt(), cfg)
