"""Mixed precision and loss scaling: fp16 overflow skips and rescales; bf16 trains; clipping; schedules in the
engine."""

from __future__ import annotations

import math

import pytest
import torch

from engine import initialize
from engine.config import ConfigError, load_config
from engine.precision import DynamicLossScaler, build_loss_scaler
from tests.reference import assert_close_relative, param_snapshot, tiny_gpt, token_batches, train_engine


def config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "steps_per_print": 10**6, **extra}


def test_dynamic_scaler_follows_deepspeed_rules():
    s = DynamicLossScaler(initial_scale=2.0**8, window=3, hysteresis=2, min_scale=64.0)
    s.update(overflow=True)
    assert s.scale == 2.0**8  # first overflow spends hysteresis
    s.update(overflow=True)
    assert s.scale == 2.0**7  # second one halves
    s.update(overflow=True)
    assert s.scale == 2.0**6  # hysteresis is still spent: halves again, down to min_loss_scale
    with pytest.raises(FloatingPointError, match="minimum loss scale 64"):  # DeepSpeed stops here too
        s.update(overflow=True)
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 64.0
    s.update(overflow=False)  # third clean step since the last overflow: grows
    assert s.scale == 128.0
    s.update(overflow=True)
    assert s.scale == 128.0  # growth refilled the hysteresis


def test_max_loss_scale_caps_the_growth_as_colossalais_max_scale():
    fp16 = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "max_loss_scale": 32}
    capped = build_loss_scaler(load_config(config(fp16=fp16)))
    for _ in range(6):
        capped.update(overflow=False)
    assert capped.scale == 32.0  # 16 -> 32 after 2 clean steps, then held there
    with pytest.raises(ConfigError, match="fp16.max_loss_scale: 8.0 — caps the dynamic loss scale below its start"):
        load_config(config(fp16={"enabled": True, "initial_scale_power": 4, "max_loss_scale": 8}))


def test_scaler_from_config():
    assert build_loss_scaler(load_config(config())).scale == 1.0
    assert build_loss_scaler(load_config(config(fp16={"enabled": True}))).scale == 2.0**16
    static = build_loss_scaler(load_config(config(fp16={"enabled": True, "loss_scale": 128})))
    static.update(overflow=True)
    assert static.scale == 128.0


def test_fp16_overflow_skips_step_and_rescales():
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 2}
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                                            "warmup_type": "linear"}}
    engine = initialize(tiny_gpt(), config(fp16=fp16, scheduler=sched))
    x = token_batches(1, 4)[0]
    engine.backward(engine(x, x))
    engine.step()  # a clean step
    before = param_snapshot(engine.module)
    lr_before = engine.get_lr()
    engine.backward(engine(x, x) * float("inf"))  # overflow
    engine.step()
    assert engine.skipped_steps == 1 and engine.global_step == 2
    assert engine.get_loss_scale() == 2.0**7
    assert not math.isfinite(engine.get_global_grad_norm())
    assert engine.get_lr() == lr_before  # the schedule does not advance on a skipped step
    for name, value in param_snapshot(engine.module).items():
        assert torch.equal(value, before[name]), f"{name} changed on a skipped step"
    assert all(torch.count_nonzero(g) == 0 for g in engine.chunked.grad_payloads())  # no inf carried over
    for _ in range(2):
        engine.backward(engine(x, x))
        engine.step()
    assert engine.get_loss_scale() == 2.0**8  # grew after loss_scale_window clean steps
    assert any(not torch.equal(v, before[n]) for n, v in param_snapshot(engine.module).items())


def test_fp16_tracks_fp32_and_backs_off_from_a_real_overflow():
    batches = token_batches(6, 4)
    fp32 = train_engine(initialize(tiny_gpt(), config()), batches, 0, 1, 1)[0]
    # 2^16 fits this model's fp16 gradients (they live in fp16 chunks: Note [master weights])
    fp16 = initialize(tiny_gpt(), config(fp16={"enabled": True}))
    assert_close_relative(train_engine(fp16, batches, 0, 1, 1)[0], fp32, rtol=1e-3)
    assert fp16.skipped_steps == 0
    # 2^20 overflows the fp16 backward: steps are skipped, halving the scale each time, until it fits
    big = initialize(tiny_gpt(), config(fp16={"enabled": True, "initial_scale_power": 20, "hysteresis": 1}))
    losses = train_engine(big, batches, 0, 1, 1)[0]
    assert 1 <= big.skipped_steps < len(batches)
    assert big.get_loss_scale() == 2.0 ** (20 - big.skipped_steps)
    assert losses[-1] < fp32[0]  # it trained once the scale fit


def test_bf16_trains_close_to_fp32():
    batches = token_batches(8, 4)
    fp32 = train_engine(initialize(tiny_gpt(), config()), batches, 0, 1, 1)[0]
    engine = initialize(tiny_gpt(), config(bf16={"enabled": True}))
    bf16 = train_engine(engine, batches, 0, 1, 1)[0]
    assert bf16[-1] < bf16[0] - 0.1, f"bf16 loss did not fall: {bf16}"
    assert_close_relative(bf16, fp32, rtol=2e-2)
    with engine.precision.autocast(engine.device):
        logits = engine.module(batches[0])
    assert logits.dtype == torch.bfloat16


@pytest.mark.parametrize("clip", [0.05, 100.0])
def test_gradient_clipping_matches_torch(clip):
    x = token_batches(1, 4)[0]
    engine = initialize(tiny_gpt(), config(gradient_clipping=clip, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    engine.backward(engine(x, x))
    engine.step()
    ref = tiny_gpt()
    ref(x, x).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert engine.get_global_grad_norm() == pytest.approx(float(norm), rel=1e-6)
    for name, value in param_snapshot(ref).items():
        torch.testing.assert_close(param_snapshot(engine.module)[name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name,params", [
    ("WarmupLR", {"warmup_min_lr": 0.002, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_min_lr": 0.002, "warmup_max_lr": 0.01, "warmup_num_steps": 2, "total_num_steps": 6,
                       "warmup_type": "linear"}),
])
def test_schedule_drives_engine_lr(name, params):
    engine = initialize(tiny_gpt(), config(scheduler={"type": name, "params": params}))
    x = token_batches(1, 4)[0]
    seen = []
    for _ in range(7):
        seen.append(engine.get_lr()[0])
        engine.backward(engine(x, x))
        engine.step()
    w, low, peak = params["warmup_num_steps"], params["warmup_min_lr"], params["warmup_max_lr"]

    def expected(k):  # DeepSpeed: update k (0-based) uses the schedule at iteration k - 1; iteration -1 and 0 agree
        i = max(k - 1, 0)
        if i < w:
            return low + (peak - low) * i / w
        if name == "WarmupLR":
            return peak
        total = params["total_num_steps"]
        return low + (peak - low) * max(0.0, (total - i) / max(1.0, total - w))

    assert seen == pytest.approx([expected(i) for i in range(7)], abs=1e-12)


def test_wall_clock_breakdown_logs_phases(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine = initialize(tiny_gpt(), config(wall_clock_breakdown=True,
                                           tensorboard={"enabled": True, "output_path": str(tmp_path),
                                                        "job_name": "w"}))
    train_engine(engine, token_batches(2, 4), 0, 1, 1)
    engine.close()
    events = EventAccumulator(str(tmp_path / "w"))
    events.Reload()
    for phase in ("forward", "backward", "optimizer"):
        points = events.Scalars(f"Time/{phase}_ms")
        assert len(points) == 2 and all(p.value > 0 for p in points)
