"""Checkpoints of expert-parallel runs are keyed by global expert id (Note [reading a checkpoint anywhere]): saved at
ep 2, they load at ep 1 and ep 4 with every expert's values and Adam moments, and training goes on as if never
stopped."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from engine.checkpoint.export import consolidate
from engine.checkpoint.files import open_tensors
from engine.checkpoint.reader import Checkpoint, PieceReader
from engine.checkpoint.whole_states import read_whole_states
from tests.distributed import run_distributed
from tests.moe_models import hf_loss
from tests.reference import assert_params_close, micro_batches
from tests.test_moe import BUILDERS, LOSSES, batches, config

pytest.importorskip("transformers")


def _train(engine, name, rank, world, steps):
    for x in steps:
        (micro,) = micro_batches(x, rank, world, 1)
        engine.backward(LOSSES.get(name, hf_loss)(engine, micro))
        engine.step()


def _save_worker(rank, world, name, stage, ep, directory):
    """Two steps, a checkpoint, then the third step: the uninterrupted run."""
    engine = initialize(BUILDERS[name](), config(stage, ep))
    _train(engine, name, rank, world, batches()[:2])
    engine.save_checkpoint(directory, "saved")
    _train(engine, name, rank, world, batches()[2:])
    return engine.full_state_dict()


def _resume_worker(rank, world, name, stage, ep, directory):
    """Another ep size loads the checkpoint into a model that starts elsewhere, saves it again, takes the third step."""
    model = BUILDERS[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    engine = initialize(model, config(stage, ep))
    engine.load_checkpoint(directory, "saved")
    engine.save_checkpoint(directory, f"resaved_ep{ep}")
    _train(engine, name, rank, world, batches()[2:])
    return engine.full_state_dict()


def _whole_worker(rank, world, name, stage, ep, directory, weights):
    """The checkpoint's weights as one whole state dict and its optimizer states whole by name (another framework's
    files), loaded into an expert-parallel engine (each rank its experts), then the third step."""
    model = BUILDERS[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    engine = initialize(model, config(stage, ep))
    engine.load_full_state_dict(weights)
    engine.load_whole_optimizer_states(read_whole_states(f"{directory}/saved"))
    _train(engine, name, rank, world, batches()[2:])
    return engine.full_state_dict()


def _states(directory: str, tag: str) -> dict[tuple[str, str], torch.Tensor]:
    """Every parameter's values and Adam moments, whole, as a checkpoint holds them."""
    checkpoint = Checkpoint(f"{directory}/{tag}")
    reader = PieceReader(checkpoint)
    return {(name, kind): reader.whole(name, kind) for name in checkpoint.param_names()
            for kind in ["param"] + checkpoint.tensor_states}


@pytest.mark.parametrize("name, stage, resume", [("mixtral", 3, [(1, 1), (4, 4)]),
                                                    ("user_no_aux", 2, [(1, 1), (4, 2)])])
def test_checkpoint_across_expert_parallel_sizes(tmp_path, name, stage, resume):
    """Saved at ep 2 over 2 ranks; loaded at ep 1 (one process) and at ep 4 / ep 2 over 4 ranks (HF Mixtral's fused
    expert tensors; engine.moe.MoE's experts by global id): the same values and moments as saved (exactly), and the
    third step equals the uninterrupted run's."""
    directory = str(tmp_path)
    uninterrupted = run_distributed(_save_worker, 2, args=(name, stage, 2, directory), timeout_s=240)[0]
    saved = _states(directory, "saved")
    assert {kind for _, kind in saved} == {"param", "exp_avg", "exp_avg_sq"}
    for world, ep in resume:
        resumed = run_distributed(_resume_worker, world, args=(name, stage, ep, directory), timeout_s=240)[0]
        again = _states(directory, f"resaved_ep{ep}")
        assert again.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(again[key], value), key
        assert_params_close(resumed, uninterrupted)
    files = consolidate(f"{directory}/saved", str(tmp_path / "whole"))  # `tiers convert`: one model, every expert
    whole = {}
    for f in [f for f in files if f.endswith(".safetensors")]:
        tensors = open_tensors(str(tmp_path / "whole" / f))
        whole.update({k: tensors.get_tensor(k) for k in tensors.keys()})
    params = {name: value for (name, kind), value in saved.items() if kind == "param"}
    assert params.keys() <= whole.keys()
    for key, value in params.items():
        assert torch.equal(whole[key], value), key
    # whole weights and whole optimizer states by name (Note [whole optimizer states]) into ep 2: the third step
    # equals the uninterrupted run's
    resumed = run_distributed(_whole_worker, 2, args=(name, stage, 2, directory, whole), timeout_s=240)[0]
    assert_params_close(resumed, uninterrupted)
