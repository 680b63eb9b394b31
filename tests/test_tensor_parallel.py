"""1D tensor parallelism (engine/tensor_parallel): the sharded model equals single-process PyTorch on the
same global batch (losses 1e-4 relative, full_state_dict after training), alone and under ZeRO."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from tests.distributed import run_distributed
from tests.reference import (assert_close_relative, assert_params_close, micro_batches, param_snapshot, tiny_gpt,
                             token_batches, train_reference)
from tests.test_data_parallel import ADAMW, adamw

TP_RTOL = 1e-4
STEPS = 3
GLOBAL_BATCH = 8


def tp_config(tp: int, dp: int, accumulation: int = 1, stage: int = 0, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp // accumulation,
            "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": ADAMW},
            "gradient_clipping": 1.0,
            "tensor_parallel": {"size": tp, "mode": "1d", "plan": "auto"},
            "zero_optimization": {"stage": stage, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 10**6, **extra}


@pytest.fixture(scope="module")
def reference():
    model = tiny_gpt(n_head=4)
    losses, norms = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0)
    return losses, norms, param_snapshot(model)


def _tp_worker(rank, world, tp, stage, accumulation):
    dp = world // tp
    engine = initialize(tiny_gpt(seed=rank, n_head=4), tp_config(tp, dp, accumulation, stage))
    assert (engine.topology.tp_size, engine.dp_world_size) == (tp, dp)
    local_param_numel = sum(p.numel() for p in engine.module.parameters())
    losses, norms = [], []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        step_losses = []
        for micro in micro_batches(x, engine.dp_rank, dp, accumulation):  # a tp group shares its data
            loss = engine(micro, micro)
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))
        norms.append(engine.get_global_grad_norm())
    full = engine.full_state_dict()
    return losses, norms, full, local_param_numel, engine.dp_rank


@pytest.mark.parametrize("world,tp,stage,accumulation", [(2, 2, 0, 1), (4, 4, 0, 2), (4, 2, 2, 1), (4, 2, 3, 1)])
def test_tensor_parallel_gpt_matches_single_process(reference, world, tp, stage, accumulation):
    ref_losses, ref_norms, ref_params = reference
    results = run_distributed(_tp_worker, world, args=(tp, stage, accumulation))
    dp = world // tp
    mean_losses = [sum(r[0][i] for r in results) / world for i in range(STEPS)]  # each dp group's mean, averaged
    assert_close_relative(mean_losses, ref_losses, rtol=TP_RTOL)
    whole = sum(p.numel() for p in ref_params.values())
    for losses, norms, full, local_numel, dp_rank in results:
        assert_close_relative(norms, ref_norms, rtol=TP_RTOL)
        assert_params_close({k: full[k] for k in ref_params}, ref_params, rtol=TP_RTOL)
        assert full.keys() == tiny_gpt(n_head=4).state_dict().keys()
        # parameter elements per rank: 1/tp of the sharded layers plus the replicated small tensors
        assert local_numel < whole / tp * 1.25, (local_numel, whole)
    for i in range(len(results)):  # ranks of one tp group see the same loss
        assert results[i][0] == results[i - i % tp][0]
    assert dp == len({r[4] for r in results})
