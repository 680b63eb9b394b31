"""Note [bytes on disk]: the NVMe store counts the bytes its swap files hold, now and at their peak (temporary
files included), as the filesystem sees them; a training step's peak on disk is what `tiers estimate` predicts
(Note [estimating model states]): one padded file per chunk of each kind homed on NVMe, gradient shards only when
they wait for the step."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from engine import initialize
from engine.estimate import EstimateSettings, estimate
from engine.estimate.strategies import Strategy
from offload.errors import SwapWriteError
from offload.nvme import NvmeStore
from tests.reference import micro_batches, tiny_gpt, token_batches

BLOCK = 4096


def files_on_disk(store: NvmeStore) -> int:
    return sum(os.path.getsize(os.path.join(store.path, name)) for name in os.listdir(store.path))


def test_the_store_counts_its_files_now_and_at_their_peak(tmp_path):
    with NvmeStore(str(tmp_path), block_size=BLOCK) as store:
        a = torch.randn(3000)  # 12,000 bytes: a 12,288-byte file
        store.write("a", a).wait()
        store.write("b", torch.randn(1000)).wait()  # 4,000 bytes: 4,096
        assert store.stats.disk_bytes == files_on_disk(store) == 16384
        store.write("a", a).wait()  # keep_previous: the new file sits beside the old one until the rename
        assert store.stats.disk_bytes == files_on_disk(store) == 16384
        assert store.stats.peak_disk_bytes == 16384 + 12288
        store.write("a", torch.randn(10_000), keep_previous=False).wait()  # in place: the file grows
        assert store.stats.disk_bytes == files_on_disk(store) == 40960 + 4096
        store.write("a", torch.randn(100), keep_previous=False).wait()  # and is cut to its size at the end
        assert store.stats.disk_bytes == files_on_disk(store) == 4096 + 4096
        store.remove("b")
        assert store.stats.disk_bytes == files_on_disk(store) == 4096
        assert store.stats.peak_disk_bytes == 40960 + 4096
    assert store.stats.disk_bytes == 0  # close removed every file


def test_a_failed_write_leaves_its_old_file_counted_and_its_partial_file_not(tmp_path, monkeypatch):
    store = NvmeStore(str(tmp_path), block_size=BLOCK)
    store.write("a", torch.arange(2048, dtype=torch.int64)).wait()  # 16,384 bytes
    real_pwrite = os.pwrite

    def half_then_enospc(fd, data, offset):
        if offset == 0 and len(data) > BLOCK:
            return real_pwrite(fd, data[: len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", half_then_enospc)
    with pytest.raises(SwapWriteError):
        store.write("a", torch.zeros(10_000, dtype=torch.int64)).wait()
    monkeypatch.undo()
    assert store.stats.disk_bytes == files_on_disk(store) == 16384
    assert store.stats.peak_disk_bytes == 16384 + 81920  # the partial file's room was asked for
    store.close()


def disk_config(optimizer: str, early: bool, accumulation: int, path: str) -> dict:
    """Everything on NVMe in one process, in small chunks: the CPU window is a small part of the states."""
    offload = {"device": "nvme", "nvme_path": path, "buffer_count": 1}
    params = {"lr": 1e-3, **({"block_size": 128} if optimizer != "AdamW" else {})}
    return {"train_micro_batch_size_per_gpu": 4 // accumulation, "gradient_accumulation_steps": accumulation,
            "steps_per_print": 10**6, "optimizer": {"type": optimizer, "params": params},
            "zero_optimization": {"stage": 3, "chunk_size": 8192, "stage3_param_persistence_threshold": 0,
                                  "offload_param": offload,
                                  "offload_optimizer": {**offload, "step_in_backward": early}},
            "aio": {"block_size": BLOCK}}


@pytest.mark.parametrize("optimizer,early,accumulation", [("AdamW8bit", True, 1), ("AdamW8bit", True, 2),
                                                          ("AdamW", True, 1), ("AdamW", False, 1)])
def test_the_step_peak_on_disk_is_the_estimate(optimizer, early, accumulation, tmp_path):
    """The estimate counts every swap file the step can need; chunks the CPU window keeps may never get one, so
    the measured peak lies between the estimate less that window and the estimate. With step_in_backward and one
    micro-batch no gradient shard is written: the peak is the resting files alone."""
    cfg = disk_config(optimizer, early, accumulation, str(tmp_path))
    row = estimate(tiny_gpt, cfg, 1, strategies=[Strategy(3, offload_optimizer="nvme", offload_param="nvme")],
                   settings=EstimateSettings(compute_on_cpu=True, nvme_path=str(tmp_path))).rows[0]
    engine = initialize(tiny_gpt(), cfg)
    manager = engine.optimizer.manager
    for batch in token_batches(3, 4):
        for x in micro_batches(batch, 0, 1, accumulation):
            engine.backward(engine(x, x))
            engine.step()
        assert manager.stats.disk_bytes == files_on_disk(manager.store)
    measured = manager.stats.peak_disk_bytes
    grads = manager.stats.nvme_written_bytes.get("grad", 0)
    engine.close()
    assert row.disk_peak - row.states.tiers.cpu <= measured <= row.disk_peak, (measured, row.disk_peak)
    assert abs(measured - row.disk_peak) <= 0.1 * row.disk_peak
    assert (grads == 0) == (early and accumulation == 1)  # gradient shards went to disk only where they wait
