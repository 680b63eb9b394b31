"""A script written for DeepSpeed (tests/deepspeed_style_train.py: argparse with add_config_arguments,
init_distributed, initialize with training_data, checkpoints with client_state, resume) runs on 2 ranks with only
its import line changed, and trains exactly as single-process PyTorch fed the batches DeepSpeed's loader gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.data.distributed import DistributedSampler

from tests.deepspeed_style_train import Net, trainset
from tests.reference import assert_close_relative, assert_params_close

SCRIPT = Path(__file__).parent / "deepspeed_style_train.py"
MICRO, EPOCHS = 4, 2
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}}


def ds_config(stage: int, bf16: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "optimizer": OPTIMIZER,
           "gradient_clipping": 1.0, "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    return {**cfg, "bf16": {"enabled": True}} if bf16 else cfg


def run_script(tmp_path: Path, config: dict, *args: str) -> list[dict]:
    """torchrun, 2 ranks: each rank's record of what it saw."""
    (tmp_path / "ds.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json"), "--epochs", str(EPOCHS),
           "--checkpoint_dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "seen"), *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return [torch.load(tmp_path / f"seen.rank{r}", weights_only=False) for r in range(2)]


def deepspeed_batches(epoch: int, world: int = 2) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, each rank's micro-batch as DeepSpeed's loader gives it: a DistributedSampler over the
    data-parallel ranks (shuffled, seed 0, padded), batches of the micro-batch size, drop_last false."""
    data = trainset()
    per_rank = []
    for rank in range(world):
        sampler = DistributedSampler(data, num_replicas=world, rank=rank)
        sampler.set_epoch(epoch)
        order = list(sampler)
        per_rank.append([order[i:i + MICRO] for i in range(0, len(order), MICRO)])
    return [[data[torch.tensor(idx)] for idx in step] for step in zip(*per_rank)]


def reference(epochs: int = EPOCHS):
    """Plain PyTorch in one process: each step the mean of the ranks' losses on their micro-batches."""
    torch.manual_seed(0)
    model = Net()
    p = OPTIMIZER["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                            weight_decay=p["weight_decay"])
    losses = []
    for epoch in range(epochs):
        for step in deepspeed_batches(epoch):
            per_rank = [nn.functional.cross_entropy(model(x), y) for x, y in step]
            loss = sum(per_rank) / len(per_rank)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append([t.item() for t in per_rank])
    return losses, {n: t.detach().clone() for n, t in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_script_runs_unchanged_and_matches_plain_pytorch(tmp_path, stage):
    ref_losses, ref_params = reference()
    seen = run_script(tmp_path, ds_config(stage))
    for rank in range(2):
        assert_close_relative(seen[rank]["losses"], [step[rank] for step in ref_losses])
        assert all(seen[rank]["applied"])
        expected = [y.tolist() for epoch in range(EPOCHS) for y in (s[rank][1] for s in deepspeed_batches(epoch))]
        assert seen[rank]["batches"] == expected  # DeepSpeed's batches, epoch by epoch
        assert_params_close({k: v for k, v in seen[rank]["state"].items() if k in ref_params}, ref_params)
    accessors = seen[1]["accessors"]
    assert accessors == {**accessors, "global_rank": 1, "world_size": 2, "local_rank": 1, "micro": MICRO,
                         "accumulation": 1, "batch": 2 * MICRO, "stage": stage, "bf16": False, "fp16": False,
                         "steps": len(ref_losses)}


def test_deepspeed_script_resumes_from_its_checkpoint(tmp_path):
    """Stopped after the first epoch and started again with --resume: load_checkpoint gives back its client_state,
    and the second epoch ends where the uninterrupted run ends."""
    ref_losses, ref_params = reference()
    first = run_script(tmp_path, ds_config(2), "--stop_after_epoch", "0")
    second = run_script(tmp_path, ds_config(2), "--resume")
    per_epoch = len(ref_losses) // EPOCHS
    for rank in range(2):
        assert_close_relative(first[rank]["losses"] + second[rank]["losses"], [s[rank] for s in ref_losses])
        assert len(second[rank]["losses"]) == per_epoch
        assert_params_close({k: v for k, v in second[rank]["state"].items() if k in ref_params}, ref_params)


def test_deepspeed_script_in_bf16(tmp_path):
    """bf16 with ZeRO-2: the script's own bf16 input cast and the engine's 16-bit chunks with fp32 masters train
    the same classifier (bf16 rounding: losses within 2e-2 of fp32 PyTorch)."""
    ref_losses, _ = reference()
    seen = run_script(tmp_path, ds_config(2, bf16=True))
    assert seen[0]["accessors"]["bf16"] is True
    for rank in range(2):
        assert_close_relative(seen[rank]["losses"], [s[rank] for s in ref_losses], rtol=2e-2)
