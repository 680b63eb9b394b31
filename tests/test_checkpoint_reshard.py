"""Resharding: a checkpoint saved under one layout (dp, tp, ZeRO stage, offload) loads under another.

The chain 2 ranks stage 3 → 4 ranks stage 2 with CPU-offloaded optimizer states → 1 process, and dp2×tp2 →
tp4 (and a 2D mesh → 1 process), each leg continuing the training. Every leg must follow the single-process
PyTorch reference (fp32 1e-5, tensor parallel 1e-4) — which needs the optimizer states to have moved with
their parameters — and a loaded model must hold exactly the weights that were saved.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from engine import initialize
from engine.cli import main
from tests.distributed import run_distributed
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
    engine = initialize(model(), config(2, 3, stage3_gather_16bit_weights_on_model_save=True))
    train_engine(engine, token_batches(STEPS, GLOBAL_BATCH)[:2], rank, world, 1)
    engine.save_checkpoint(os.path.join(root, "stage3_dp2"))
    exported = engine.save_16bit_model(os.path.join(root, "export"))  # fp32 here: the compute dtype
    assert (exported is not None) == (rank == 0)
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
    saved = out["dp2_tp2_weights"] = engine.full_state_dict()
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
    saved = engine.full_state_dict()
    engine.close()
    engine = initialize(model(), config(2, 1, tp=2))  # the 2D mesh's pieces cut again in 1D, over dp 2
    engine.load_checkpoint(os.path.join(root, "tp2d"))
    loaded = engine.full_state_dict()
    out["tp2d_loaded_at_dp2_tp2_exactly"] = all(torch.equal(loaded[k], saved[k]) for k in saved)
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
    return root, four, saved


def test_stage3_on_2_ranks_loads_as_stage2_on_4_ranks_with_offloaded_states(chain, reference):
    _, four, _ = chain
    for rank in range(4):
        assert four[rank]["loaded_exactly"], f"rank {rank}: the loaded weights differ from the saved ones"
    mean = [sum(four[r]["stage2_dp4"][i] for r in range(4)) / 4 for i in range(2)]  # each rank's rows
    assert_close_relative(mean, reference[0][2:4])


def test_then_loads_in_one_process(chain, reference):
    root, _, _ = chain
    engine = initialize(model(), config(1, 0))
    path, _ = engine.load_checkpoint(os.path.join(root, "stage2_dp4"))
    assert path.endswith("global_step4") and engine.global_step == 4
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH)[4:], 0, 1, 1)
    assert_close_relative(losses, reference[0][4:])
    assert_params_close(trained_params(engine), reference[1])


def test_dp2_tp2_loads_as_tp4(chain, reference):
    _, four, _ = chain
    for rank in range(4):
        assert four[rank]["tp_loaded_exactly"], f"rank {rank}: the weights loaded under tp 4 differ from the saved ones"
        assert_close_relative(four[rank]["tp4"], reference[0][2:4], rtol=TP_RTOL)


def test_a_2d_mesh_loads_in_one_process_and_as_dp2_by_tp2(chain, reference):
    root, four, _ = chain
    assert all(out["tp2d_loaded_at_dp2_tp2_exactly"] for out in four)
    engine = initialize(model(), config(1, 3))  # and as ZeRO-3, which shards nothing in one process
    engine.load_checkpoint(os.path.join(root, "tp2d"))
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH)[2:4], 0, 1, 1)
    assert_close_relative(losses, reference[0][2:4], rtol=TP_RTOL)


def _read_index(out: str) -> dict[str, torch.Tensor]:
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    state = {}
    for name in files:
        state.update(load_file(os.path.join(out, name)))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    return state, files


def test_convert_writes_the_full_state_dict(chain, tmp_path):
    root, four, stage3_weights = chain
    assert main(["convert", os.path.join(root, "stage3_dp2"), str(tmp_path / "a")]) == 0  # through `latest`
    converted = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert converted.keys() == stage3_weights.keys()  # every key, the tied lm_head.weight included
    assert all(torch.equal(converted[k], stage3_weights[k]) for k in stage3_weights)

    tp_weights = four[0]["dp2_tp2_weights"]
    ckpt = os.path.join(root, "dp2_tp2", "global_step2")
    assert main(["convert", ckpt, str(tmp_path / "b"), "--max-shard-size", "60KB"]) == 0  # tp pieces joined
    converted, files = _read_index(str(tmp_path / "b"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert converted.keys() == tp_weights.keys()
    assert all(torch.equal(converted[k], tp_weights[k]) for k in tp_weights)


def test_convert_names_what_is_wrong(tmp_path, capsys):
    assert main(["convert", str(tmp_path), str(tmp_path / "out")]) == 1
    assert "neither a checkpoint nor a directory with a 'latest' file" in capsys.readouterr().err


def test_save_16bit_model_writes_whole_weights_under_stage_3(chain):
    root, _, stage3_weights = chain
    exported = load_file(os.path.join(root, "export", "model.safetensors"))
    assert exported.keys() == stage3_weights.keys()
    assert all(torch.equal(exported[k], stage3_weights[k]) for k in stage3_weights)


def test_save_16bit_model_in_bf16(tmp_path):
    engine = initialize(model(), {**config(1, 0), "bf16": {"enabled": True}})
    train_engine(engine, token_batches(1, GLOBAL_BATCH), 0, 1, 1)
    path = engine.save_16bit_model(str(tmp_path), "weights.safetensors")
    exported, masters = load_file(path), engine.full_state_dict()
    assert exported["wte.weight"].dtype == torch.bfloat16
    assert all(torch.equal(exported[k], masters[k].to(torch.bfloat16)) for k in masters)


def test_then_loads_in_one_process_paging_everything_through_nvme(chain, reference, tmp_path):
    """Note [paging in one process]: the 4-rank stage-2 checkpoint loads into one process whose parameter shards,
    gradients and optimizer states all live on NVMe, and training goes on as PyTorch's."""
    root, _, _ = chain
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = config(1, 3, offload_optimizer=offload, offload_param=offload)
    cfg.update(aio={"block_size": 4096}, memory={"cpu_budget": 600_000})  # far below the 1.9 MB of states
    engine = initialize(model(), cfg)
    path, _ = engine.load_checkpoint(os.path.join(root, "stage2_dp4"))
    assert path.endswith("global_step4") and engine.global_step == 4
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH)[4:], 0, 1, 1)
    assert_close_relative(losses, reference[0][4:])
    assert_params_close(trained_params(engine), reference[1])
    stats = engine.optimizer.manager.stats
    assert stats.resident_bytes["nvme"] > 0 and stats.peak_bytes["cpu"] <= 600_000
    engine.close()
