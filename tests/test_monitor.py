"""TensorBoard event files written by the engine, read back with TensorBoard's own reader."""

from __future__ import annotations

import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from engine import initialize
from tests.reference import tiny_gpt, token_batches, train_engine

EXPECTED_TAGS = {"Train/loss", "Train/lr", "Train/loss_scale", "Train/grad_norm", "Train/skipped_steps",
                 "Throughput/samples_per_sec", "Throughput/tokens_per_sec", "Time/step_ms", "Memory/rss_bytes",
                 "Comm/bytes_per_step", "Comm/all_reduce_bytes_per_step", "Comm/reduce_scatter_bytes_per_step",
                 "Comm/all_gather_bytes_per_step", "Memory/chunk_bytes/param", "Memory/chunk_bytes/grad",
                 "Memory/chunk_bytes/optim"}


def test_tensorboard_has_one_point_per_step(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**6,
           "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb_test"}}
    engine = initialize(tiny_gpt(), cfg)
    steps = 5
    losses, norms = train_engine(engine, token_batches(steps, 4), 0, 1, 2)
    engine.close()
    events = EventAccumulator(str(tmp_path / "tb_test"))
    events.Reload()
    assert EXPECTED_TAGS <= set(events.Tags()["scalars"])
    loss_points = events.Scalars("Train/loss")
    assert [p.step for p in loss_points] == list(range(1, steps + 1))
    for point, loss in zip(loss_points, losses):
        assert math.isclose(point.value, loss, rel_tol=1e-6)  # the mean of the step's micro-batch losses
    assert all(math.isclose(p.value, n, rel_tol=1e-6) for p, n in zip(events.Scalars("Train/grad_norm"), norms))
    assert all(p.value > 0 for p in events.Scalars("Memory/rss_bytes"))
    assert all(p.value > 0 for p in events.Scalars("Throughput/tokens_per_sec"))
    psi = sum(p.numel() for p in engine.module.parameters())
    param_bytes = [p.value for p in events.Scalars("Memory/chunk_bytes/param")]
    assert all(4 * psi <= v <= 4 * psi * 1.25 for v in param_bytes)  # fp32 chunks: Ψ·4B plus padding
    assert [p.value for p in events.Scalars("Memory/chunk_bytes/optim")] == [2 * v for v in param_bytes]  # Adam


def test_tensorboard_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = initialize(tiny_gpt(), {"train_batch_size": 2, "optimizer": {"type": "SGD"}, "steps_per_print": 10**6})
    train_engine(engine, token_batches(2, 2), 0, 1, 1)
    engine.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_has_the_chunk_managers_tiers_and_traffic_per_step(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "steps_per_print": 10**6, "aio": {"block_size": 4096},
           "zero_optimization": {"chunk_size": 20_000,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")}},
           "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb_offload"}}
    (tmp_path / "swap").mkdir()
    engine = initialize(tiny_gpt(), cfg)
    train_engine(engine, token_batches(3, 4), 0, 1, 1)
    stats = engine.optimizer.manager.stats
    engine.close()
    events = EventAccumulator(str(tmp_path / "tb_offload"))
    events.Reload()
    read = [p.value for p in events.Scalars("Offload/moved_bytes_per_step/nvme->cpu")]
    # the states start as zeros without a file (register(zeros=True)): the first step reads nothing back
    assert len(read) == 2 and all(v > 0 for v in read)
    assert sum(read) == stats.moved_bytes["nvme->cpu"]  # per-step deltas add up to the manager's count
    assert events.Scalars("Offload/resident_bytes/nvme")[-1].value == stats.resident_bytes["nvme"] > 0
