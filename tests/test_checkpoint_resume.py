"""Exact resume: train, save, start new processes, load, continue — the same losses and weights, bit for bit.

Every layout below trains 2 ranks with dropout 0.1, gradient clipping and a warm-up schedule (so RNG,
optimizer states, schedule and counters all matter), saves after 3 steps and goes on for 3 more; fresh
processes then build the same engine, load the checkpoint and train the same 3 steps.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import engine.checkpoint.files as checkpoint_files
from engine import initialize
from tests.distributed import run_distributed
from tests.reference import micro_batches, tiny_gpt, token_batches
from tests.test_zero import zero_config

SAVE_AT, STEPS, GLOBAL_BATCH = 3, 6, 8

LAYOUTS = {  # name -> (stage, offload, extra config)
    "stage0": (0, None, {}),
    "stage1": (1, None, {}),
    "stage2": (2, None, {}),
    "stage3": (3, None, {}),
    "stage0_nvme": (0, "nvme", {}),
    "stage1_nvme": (1, "nvme", {}),
    "stage2_nvme": (2, "nvme", {}),
    "stage3_nvme": (3, "nvme", {}),  # parameter shards on NVMe too
    "stage2_bf16": (2, None, {"bf16": {"enabled": True}}),
    # fp32 masters, 16-bit gradient and parameter shards all in the manager (Note [offloaded master weights])
    "stage3_nvme_bf16": (3, "nvme", {"bf16": {"enabled": True}}),
    "tp2": (0, None, {"tensor_parallel": {"size": 2}}),
    # written in the background while the next steps change the weights: the snapshot must be a copy
    "stage1_async": (1, None, {"checkpoint": {"async_save": True}}),
    "stage3_nvme_async": (3, "nvme", {"checkpoint": {"async_save": True}}),
}


def layout_config(name: str, root: str, rank: int) -> dict:
    stage, offload, extra = LAYOUTS[name]
    tp = extra.get("tensor_parallel", {}).get("size", 1)
    cfg = zero_config(stage, GLOBAL_BATCH // (2 // tp), 1)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3}}
    if offload:
        nvme = root  # the store makes a private directory per process in it
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    cfg.update(extra)
    return cfg


def _train(engine, batches, steps, rank, world) -> list[float]:
    losses = []
    for step in steps:
        (x,) = micro_batches(batches[step], engine.dp_rank, engine.dp_world_size, 1)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _slow_disk(save_file):
    """The background writer starts late, after the next steps have changed the weights (tiny files are written
    before training resumes otherwise): a snapshot that is not a copy would then be caught."""
    def delayed(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # a background save
            time.sleep(1.0)
        return save_file(*args, **kwargs)
    return delayed


def _save_worker(rank, world, root):
    checkpoint_files.save_file = _slow_disk(checkpoint_files.save_file)  # this process only
    out = {}
    batches = token_batches(STEPS, GLOBAL_BATCH)
    for name in LAYOUTS:
        engine = initialize(tiny_gpt(seed=0, dropout=0.1), layout_config(name, root, rank))
        _train(engine, batches, range(SAVE_AT), rank, world)
        engine.save_checkpoint(os.path.join(root, name), client_state={"next_step": SAVE_AT})
        losses = _train(engine, batches, range(SAVE_AT, STEPS), rank, world)
        out[name] = losses, engine.full_state_dict()
        engine.close()
    return out


def _resume_worker(rank, world, root):
    out = {}
    batches = token_batches(STEPS, GLOBAL_BATCH)
    torch.manual_seed(1234 + rank)  # the fresh processes' generators start elsewhere: loading must restore them
    for name in LAYOUTS:
        engine = initialize(tiny_gpt(seed=7, dropout=0.1), layout_config(name, root, rank))  # other weights, too
        path, client = engine.load_checkpoint(os.path.join(root, name))
        assert path == os.path.join(root, name, f"global_step{SAVE_AT}") and client == {"next_step": SAVE_AT}
        assert engine.global_step == SAVE_AT
        losses = _train(engine, batches, range(client["next_step"], STEPS), rank, world)
        out[name] = losses, engine.full_state_dict()
        engine.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    uninterrupted = run_distributed(_save_worker, 2, (root,), timeout_s=300)
    resumed = run_distributed(_resume_worker, 2, (root,), timeout_s=300)
    return uninterrupted, resumed


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_in_new_processes_is_bit_identical(runs, name):
    uninterrupted, resumed = runs
    for rank in range(2):
        losses, weights = uninterrupted[rank][name]
        again, weights_again = resumed[rank][name]
        assert again == losses, f"{name} rank {rank}: {again} vs {losses}"
        assert weights.keys() == weights_again.keys()
        for key in weights:
            assert torch.equal(weights[key], weights_again[key]), f"{name} rank {rank}: {key} differs"
