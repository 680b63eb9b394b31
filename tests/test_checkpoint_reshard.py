"""Resharding: a checkpoint saved under one layout (dp, tp, ZeRO stage, offload) loads under another.

The chain 2 ranks stage 3 → 4 ranks stage 2 with CPU-offloaded optimizer states → 1 process, and dp2×tp2 →
tp4 (and a 2D mesh → 1 process), each leg continuing the training. Every leg must follow the single-process
PyTorch reference (fp32 1e-5, tensor parallel 1e-4) — which needs the optimizer states to have moved with
their parameters — and a loaded model must hold exactly the weights that were saved.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine import initialize
from tests.distributed import run_distributed
from tests.reference import (assert_close_relative, assert_params_close, param_snapshot, tiny_gpt, token_batches,
                             train_engine, train_reference, trained_params)
from tests.test_data_parallel import adamw
from tests.test_zero import zero_config

STEPS, GLOBAL_BATCH, TP_RTOL = 6, 8, 1e-4


def model():
    return tiny_gpt(seed=0, n_head=4)  # 4 heads: tp 4 splits them


def config(dp: int, stage: int, tp: int = 1, mode: str = "1d", **zero) -> dict:
    cfg = zero_config(stage, GLOBAL_BATCH // dp, 1, **zero)
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp, "mode": mode}
    return cfg


def _stage3_worker(rank, world, root):
    engine = initialize(model(), config(2, 3))
    train_engine(engine, token_batches(STEPS, GLOBAL_BATCH)[:2], rank, world, 1)
    engine.save_checkpoint(os.path.join(root, "stage3_dp2"))
    return engine.full_state_dict()


def _four_rank_worker(rank, world, root, saved_weights):
    batches = token_batches(STEPS, GLOBAL_BATCH)
    out = {}
    engine = initialize(model(), config(4, 2, offload_optimizer={"device": "cpu"}))
    engine.load_checkpoint(os.path.join(root, "stage3_dp2"))
    loaded = engine.full_state_dict()
    out["loaded_exactly"] = all(torch.equal(loaded[k], saved_weights[k]) for k in saved_weights)
    out["stage2_dp4"] = train_engine(engine, batches[2:4], rank, world, 1)[0]
    engine.save_checkpoint(os.path.join(root, "stage2_dp4"))
    engine.close()

    engine = initialize(model(), config(2, 1, tp=2))
    train_engine(engine, batches[:2], engine.dp_rank, engine.dp_world_size, 1)
    engine.save_checkpoint(os.path.join(root, "dp2_tp2"))
    saved = engine.full_state_dict()
    engine.close()
    engine = initialize(model(), config(1, 0, tp=4))
    engine.load_checkpoint(os.path.join(root, "dp2_tp2"))
    loaded = engine.full_state_dict()
    out["tp_loaded_exactly"] = all(torch.equal(loaded[k], saved[k]) for k in saved)
    out["tp4"] = train_engine(engine, batches[2:4], 0, 1, 1)[0]
    out["tp4_params"] = trained_params(engine)
    engine.close()

    engine = initialize(model(), config(1, 0, tp=4, mode="2d"))
    train_engine(engine, batches[:2], 0, 1, 1)
    engine.save_checkpoint(os.path.join(root, "tp2d"))
    engine.close()
    return out


@pytest.fixture(scope="module")
def reference():
    net = model()
    losses, _ = train_reference(net, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0)
    return losses, param_snapshot(net)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    saved = run_distributed(_stage3_worker, 2, (root,), timeout_s=120)[0]
    four = run_distributed(_four_rank_worker, 4, (root, saved), timeout_s=240)
    return root, four


def test_stage3_on_2_ranks_loads_as_stage2_on_4_ranks_with_offloaded_states(chain, reference):
    _, four = chain
    for rank in range(4):
        assert four[rank]["loaded_exactly"], f"rank {rank}: the loaded weights differ from the saved ones"
    mean = [sum(four[r]["stage2_dp4"][i] for r in range(4)) / 4 for i in range(2)]  # each rank's rows
    assert_close_relative(mean, reference[0][2:4])


def test_then_loads_in_one_process(chain, reference):
    root, _ = chain
    engine = initialize(model(), config(1, 0))
    path, _ = engine.load_checkpoint(os.path.join(root, "stage2_dp4"))
    assert path.endswith("global_step4") and engine.global_step == 4
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH)[4:], 0, 1, 1)
    assert_close_relative(losses, reference[0][4:])
    assert_params_close(trained_params(engine), reference[1])


def test_dp2_tp2_loads_as_tp4(chain, reference):
    _, four = chain
    for rank in range(4):
        assert four[rank]["tp_loaded_exactly"], f"rank {rank}: the weights loaded under tp 4 differ from the saved ones"
        assert_close_relative(four[rank]["tp4"], reference[0][2:4], rtol=TP_RTOL)


def test_a_2d_mesh_loads_in_one_process(chain, reference):
    root, _ = chain
    engine = initialize(model(), config(1, 3))  # and as ZeRO-3, which shards nothing in one process
    engine.load_checkpoint(os.path.join(root, "tp2d"))
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH)[2:4], 0, 1, 1)
    assert_close_relative(losses, reference[0][2:4], rtol=TP_RTOL)
