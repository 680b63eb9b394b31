"""bf16 / fp16 parameter chunks with fp32 master weights (Note [master weights]): training equals plain
PyTorch mixed precision, and model-state bytes per rank follow the ZeRO paper's 2Ψ + 2Ψ + 12Ψ split."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_engine,
    train_reference_mixed,
    trained_params,
)
from tests.test_data_parallel import ADAMW, adamw
from tests.test_zero import GLOBAL_BATCH, model_state_bytes, zero_config

STEPS = 4
# a 1-ulp rounding difference of a 16-bit weight (bf16: 2^-8 relative) is within these
WEIGHT_RTOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
LOSS_RTOL = {torch.bfloat16: 2e-3, torch.float16: 5e-4}


def precision_config(stage: int, dtype: torch.dtype, micro: int, accumulation: int) -> dict:
    cfg = zero_config(stage, micro, accumulation)
    cfg["bf16" if dtype == torch.bfloat16 else "fp16"] = (
        {"enabled": True} if dtype == torch.bfloat16 else {"enabled": True, "loss_scale": 2.0**10})
    return cfg


def reference(dtype):
    model = tiny_gpt()
    scale = 2.0**10 if dtype == torch.float16 else 1.0
    return train_reference_mixed(model, token_batches(STEPS, GLOBAL_BATCH), dtype, adamw, clip=1.0, loss_scale=scale)


def assert_weights_close(actual, expected, dtype, run_dtype, atol=1e-3):
    """Weights of `dtype` (16-bit parameters, or fp32 masters) of a run in `run_dtype`."""
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == dtype, name
        torch.testing.assert_close(actual[name].float(), expected[name].float(), rtol=WEIGHT_RTOL[run_dtype], atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _worker(rank, world, stage, dtype, accumulation, nvme_dir=None):
    cfg = precision_config(stage, dtype, GLOBAL_BATCH // world // accumulation, accumulation)
    if nvme_dir:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
    engine = initialize(tiny_gpt(seed=rank), cfg)
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), rank, world, accumulation)
    state = model_state_bytes(engine)
    if nvme_dir:  # masters, Adam's states and gradient shards are in the chunk manager, on NVMe and in its window
        stats = engine.optimizer.manager.stats
        state["manager"] = stats.resident_bytes["cpu"] + stats.resident_bytes["nvme"]
    params = trained_params(engine)
    engine.close()
    return losses, params, state, engine.skipped_steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_process_equals_plain_pytorch_mixed_precision(dtype):
    ref_losses, ref_params, ref_masters = reference(dtype)
    engine = initialize(tiny_gpt(), precision_config(0, dtype, GLOBAL_BATCH, 1))
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH), 0, 1, 1)
    assert engine.skipped_steps == 0
    assert_close_relative(losses, ref_losses, rtol=LOSS_RTOL[dtype])
    assert_weights_close(param_snapshot(engine.module), ref_params, dtype, dtype)  # what the model computes with
    assert_weights_close(trained_params(engine), ref_masters, torch.float32, dtype)  # full_state_dict: fp32 masters


# bytes per parameter, (replicated, sharded over N): 16-bit params and grads, fp32 master + Adam's two states
FORMULA = {1: {"param": (2, 0), "grad": (2, 0), "optim": (0, 12)},
           2: {"param": (2, 0), "grad": (0, 2), "optim": (0, 12)},
           3: {"param": (0, 2), "grad": (0, 2), "optim": (0, 12)}}


@pytest.mark.parametrize("stage,dtype,accumulation,offload", [
    (1, torch.bfloat16, 2, False), (2, torch.bfloat16, 1, False), (3, torch.bfloat16, 2, False),
    (3, torch.float16, 1, False), (3, torch.bfloat16, 1, True)])
def test_zero_stages_with_16_bit_chunks_match_plain_pytorch_and_the_memory_split(stage, dtype, accumulation, offload,
                                                                                 tmp_path):
    ref_losses, _, ref_masters = reference(dtype)
    world = 2
    results = run_distributed(_worker, world, args=(stage, dtype, accumulation, str(tmp_path) if offload else None))
    # two ranks reduce 16-bit gradients (each rounded) where one process computes them in one pass
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses,
                          rtol=5 * LOSS_RTOL[dtype])
    psi = sum(p.numel() for p in ref_masters.values())
    padding = 20_000 * 4  # at most one chunk of padding per kind, in bytes
    for _, params, state, skipped in results:
        assert skipped == 0
        # Adam normalizes each element's step: where a gradient is near zero, the rounding of 16-bit reductions
        # can change it by up to lr per step, so weights may differ by STEPS * lr in absolute terms there
        assert_weights_close(params, ref_masters, torch.float32, dtype, atol=STEPS * ADAMW["lr"])  # the fp32 masters
        formula = dict(FORMULA[stage])
        if offload:  # Note [offloaded master weights]: masters, states and 16-bit gradient shards in the manager
            assert state["optim"] == state["grad"] == 0
            formula = {"param": formula["param"], "manager": (0, 12 + 2)}
        for kind, (replicated, sharded) in formula.items():
            expected = replicated * psi + sharded * psi / world
            slack = 4 * 4096 * 8 if kind == "manager" else 0  # the NVMe files' O_DIRECT block padding
            assert abs(state[kind] - expected) <= 0.05 * expected + padding + slack, (kind, state[kind], expected)
