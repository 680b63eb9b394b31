"""bf16 / fp16 with parameters, fp32 masters, optimizer states and gradient shards offloaded (Notes [offloaded
master weights], [paging in one process]): training equals the same precision without offload — one process and
two ranks, CPU and NVMe homes, with gradient accumulation and clipping — and every byte of model state per
parameter sits where the formula puts it."""

from __future__ import annotations

import os

import pytest
import torch

from engine import initialize
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    tiny_gpt,
    token_batches,
    train_engine,
    trained_params,
)
from tests.test_mixed_precision import precision_config
from tests.test_zero import GLOBAL_BATCH, model_state_bytes

STEPS = 4
ACCUMULATION = 2


def _worker(rank, world, dtype, home, nvme_dir):
    cfg = precision_config(3, dtype, GLOBAL_BATCH // world // ACCUMULATION, ACCUMULATION)
    if home is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": home, "nvme_path": nvme_dir}
        cfg["zero_optimization"]["offload_param"] = {"device": home, "nvme_path": nvme_dir}
        cfg["aio"] = {"block_size": 4096}  # small blocks: the CPU window is then far below the model's states
    engine = initialize(tiny_gpt(seed=rank), cfg)
    losses, norms = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, ACCUMULATION)
    in_memory = model_state_bytes(engine)
    manager = engine.optimizer.manager if home is not None else None
    stats = manager.stats if manager is not None else None
    chunks = sum(len(manager.chunks_of(k)) for k in ("param", "grad", "master", "optim")) if manager else 0
    params = trained_params(engine)  # the fp32 masters, whole
    engine.close()
    return losses, norms, params, in_memory, stats, engine.skipped_steps, chunks


def _run(world, dtype, home, nvme_dir):
    args = (dtype, home, nvme_dir)
    return [_worker(0, 1, *args)] if world == 1 else run_distributed(_worker, world, args=args)


@pytest.mark.parametrize("world,dtype,home", [
    (1, torch.bfloat16, "cpu"), (1, torch.bfloat16, "nvme"), (1, torch.float16, "nvme"),
    (2, torch.bfloat16, "nvme"), (2, torch.float16, "cpu")])
def test_16_bit_training_with_everything_offloaded_equals_it_without_offload(tmp_path, world, dtype, home):
    expected = _run(world, dtype, None, None)
    results = _run(world, dtype, home, str(tmp_path))
    for (losses, norms, params, in_memory, stats, skipped, chunks), ref in zip(results, expected):
        assert skipped == ref[5] == 0
        assert_close_relative(losses, ref[0])  # same 16-bit forward, same fp32 update
        assert_close_relative(norms, ref[1])
        assert_params_close(params, ref[2])  # the fp32 masters
        assert in_memory == {"param": 0, "grad": 0, "optim": 0}  # every model state is in the manager
        psi = sum(p.numel() for p in params.values())
        # 2 (16-bit parameter shard) + 4 (fp32 master) + 8 (exp_avg, exp_avg_sq), + 2 (16-bit gradient shard) where
        # its buffer is still held once the step consumed it (with NVMe it is dropped); each chunk's host buffer may
        # round up to an O_DIRECT block and slide onto a page (Note [host buffer pool])
        held = stats.resident_bytes["cpu"] + stats.resident_bytes["nvme"]
        assert 14 * psi / world <= held <= 16 * psi / world + chunks * 2 * 4096
        if home == "nvme":
            assert stats.resident_bytes["nvme"] > 0 and stats.moved_bytes["nvme->cpu"] > 0
            assert stats.peak_bytes["cpu"] < 16 * psi / world  # a window, not the model's states
    assert os.listdir(tmp_path) == []


def test_fp16_overflow_skips_the_step_with_everything_offloaded(tmp_path):
    """A loss scale so large that the 16-bit gradients overflow: the step is skipped and the offloaded
    weights stay as they were (the optimizer never reads the streamed shards)."""
    cfg = precision_config(3, torch.float16, GLOBAL_BATCH, 1)
    cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 32}  # dynamic, starting at 2^32
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    engine = initialize(tiny_gpt(), cfg)
    before = trained_params(engine)
    x = token_batches(1, GLOBAL_BATCH)[0]
    engine.backward(engine(x, x))
    engine.step()
    assert engine.skipped_steps == 1
    after = trained_params(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)
    engine.close()
