"""`pin_memory: true`, in nearly every offload config, is honoured where a pinned allocator exists and ignored,
with one log line, where none does (this CPU-only machine): the same config trains either way."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import initialize
from offload.host_pool import pinned_memory_available
from offload.manager import ChunkManager
from tests.reference import assert_close_relative, tiny_gpt, token_batches, train_engine, train_reference

needs_no_accelerator = pytest.mark.skipif(pinned_memory_available(), reason="this machine can pin host memory")


@needs_no_accelerator
def test_a_chunk_manager_asked_to_pin_uses_plain_buffers_and_says_so_once(caplog):
    with caplog.at_level(logging.WARNING, logger="tiers.offload"):
        manager = ChunkManager("cpu", pin_memory=True)
    assert not manager.pool.pinned
    assert len(caplog.records) == 1 and "pin_memory" in caplog.records[0].getMessage()
    buffer = manager.pool.acquire(1000, torch.float32)
    assert not buffer.is_pinned()
    manager.close()


@needs_no_accelerator
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_an_offload_config_with_pin_memory_trains_as_pytorch_does(tmp_path, caplog, device):
    offload = {"device": device, "pin_memory": True, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "steps_per_print": 10**6, "aio": {"block_size": 4096},
           "zero_optimization": {"stage": 1, "offload_optimizer": offload}}
    batches = token_batches(3, 4)
    with caplog.at_level(logging.WARNING, logger="tiers.offload"):
        engine = initialize(tiny_gpt(), cfg)
    losses, _ = train_engine(engine, batches, 0, 1, 1)
    engine.close()
    reference, _ = train_reference(tiny_gpt(), batches, lambda params: torch.optim.AdamW(params, lr=1e-3))
    assert_close_relative(losses, reference)
    assert sum("pin_memory" in r.getMessage() for r in caplog.records) == 1
