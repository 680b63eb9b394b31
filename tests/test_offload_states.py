"""engine.offload_states / reload_states (DeepSpeed's) where the device's memory is its own (the CPU seam, Note
[separate device memory]): the offloaded kinds leave the device, training is refused until they are reloaded,
and training after the round trip equals training without it bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.compat import deepspeed
from offload.device_memory import SEPARATE_ENV
from tests.distributed import run_distributed
from tests.reference import trained_params

STEPS = 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def config(stage: int, bf16: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}}


def train(cfg: dict, round_trip, rank: int = 0) -> dict[str, torch.Tensor]:
    """STEPS steps; after each, round_trip(engine) (None: nothing). Returns the whole parameters."""
    engine, *_ = deepspeed.initialize(model=model(), config=cfg)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        x = torch.randn(4, 16, generator=g)
        engine.backward(engine(x).float().square().mean())
        engine.step()
        if round_trip is not None:
            round_trip(engine)
    return trained_params(engine.engine)


@pytest.mark.parametrize("stage,bf16", [(1, False), (2, True)])
def test_offloaded_states_leave_the_device_and_come_back_exactly(monkeypatch, stage, bf16):
    monkeypatch.setenv(SEPARATE_ENV, "1")
    cfg = config(stage, bf16)
    seen = []
    moved = train(cfg, lambda engine: seen.append(round_trip(engine)))
    plain = train(cfg, None)
    for name, value in plain.items():
        assert torch.equal(moved[name], value), name
    for before, after in seen:
        assert before["param"] > 0 and before["grad"] > 0 and before["optim"] > 0 and (before["master"] > 0) == bf16
        assert after == {kind: 0 for kind in before}


def round_trip(engine) -> tuple[dict[str, int], dict[str, int]]:
    """Offloads every state, checks that training is refused, reloads; the device bytes before and while offloaded."""
    before = engine.device_state_bytes()
    engine.offload_states()
    after = engine.device_state_bytes()
    with pytest.raises(RuntimeError, match=r"engine\.forward.*reload_states\(\)"):
        engine(torch.zeros(4, 16))
    with pytest.raises(RuntimeError, match=r"engine\.step.*reload_states\(\)"):
        engine.step()
    with pytest.raises(RuntimeError, match=r"engine\.save_checkpoint.*reload_states\(\)"):
        engine.save_checkpoint("not-written")
    engine.reload_states()
    assert engine.device_state_bytes() == before
    return before, after


def _stage3_worker(rank, world):
    cfg = config(3, False)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter sharded
    seen = []
    moved = train(cfg, lambda engine: seen.append(round_trip(engine)), rank)
    plain = train(cfg, None, rank)
    return all(torch.equal(moved[n], v) for n, v in plain.items()), seen


def test_stage_3_shards_leave_the_device_and_come_back_exactly_on_two_ranks(monkeypatch):
    monkeypatch.setenv(SEPARATE_ENV, "1")  # the spawned ranks inherit it
    for equal, seen in run_distributed(_stage3_worker, 2):
        assert equal
        for before, after in seen:
            assert before["param"] > 0 and before["grad"] > 0 and before["optim"] > 0
            assert after == {kind: 0 for kind in before}


def test_only_the_included_kinds_move(monkeypatch):
    monkeypatch.setenv(SEPARATE_ENV, "1")
    seen = []

    def optimizer_states_only(engine):
        before = engine.device_state_bytes()
        engine.offload_states(include=[deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum.optim_states])
        seen.append((before, engine.device_state_bytes()))
        engine.reload_states()

    moved = train(config(2, True), optimizer_states_only)
    plain = train(config(2, True), None)
    assert all(torch.equal(moved[n], v) for n, v in plain.items())
    for before, after in seen:
        assert after["optim"] == 0 < before["optim"]
        assert {k: after[k] for k in ("param", "grad", "master")} == {k: before[k] for k in ("param", "grad", "master")}
