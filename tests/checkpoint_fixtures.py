"""Checkpoints written by an earlier Tiers, committed under tests/fixtures/checkpoints/, which every later Tiers must
load (tests/test_checkpoint_fixtures.py): each layout's tiny training run, and the whole weights it saved.

    .venv/bin/python -m tests.checkpoint_fixtures   # writes them again (only when adding a layout: the committed
                                                    # ones are the format a released Tiers wrote)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine import initialize
from tests.distributed import run_distributed
from tests.moe_models import UserMoEModel
from tests.reference import micro_batches, tiny_gpt, token_batches

ROOT = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
TAG, STEPS, GLOBAL_BATCH, SEQ = "fixture", 2, 4, 16
ADAMW = {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}


def gpt():
    return tiny_gpt(0, n_embd=16, n_head=2, block_size=SEQ)


def moe():
    return UserMoEModel(hidden=8, num_experts=2, k=1, drop_tokens=False)


def config(stage: int, world: int = 1, accumulation: int = 1, **parallel) -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world // accumulation,
            "gradient_accumulation_steps": accumulation, "optimizer": {"type": "AdamW", "params": ADAMW},
            "steps_per_print": 10**6, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            **parallel}


# name -> (model builder, the layout saved on 2 ranks, the batch rows per rank: 0 splits them over dp)
LAYOUTS = {
    "zero3_dp2": (gpt, config(3, world=2)),
    "tp2": (gpt, config(1, tensor_parallel={"size": 2})),
    "pp2": (gpt, config(1, accumulation=2, pipeline={"stages": 2, "schedule": "1f1b"})),
    "ep2_dp2": (moe, config(2, world=2, moe={"expert_parallel_size": 2})),
}


def train(engine, model_name: str) -> None:
    accumulation = engine.gradient_accumulation_steps
    for batch in token_batches(STEPS, GLOBAL_BATCH, seq=SEQ):
        mbs = micro_batches(batch, engine.dp_rank, engine.dp_world_size, accumulation)
        if engine.pipeline is not None:
            engine.train_batch(iter([{"input_ids": x, "labels": x} for x in mbs]))
            continue
        for x in mbs:
            engine.backward(engine(x, x) if model_name == "ep2_dp2" else engine(input_ids=x, labels=x))
            engine.step()


def _save_worker(rank, world, name, directory):
    build, cfg = LAYOUTS[name]
    engine = initialize(build(), cfg)
    train(engine, name)
    engine.save_checkpoint(directory, TAG)
    whole = engine.full_state_dict()
    if rank == 0:
        save_file({k: v.clone() for k, v in whole.items()}, os.path.join(directory, "expected.safetensors"))
    engine.close()


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT.parent.parent.parent).stdout.strip()
    for name in LAYOUTS:
        directory = ROOT / name
        shutil.rmtree(directory, ignore_errors=True)
        run_distributed(_save_worker, 2, (name, str(directory)))
        (directory / "WRITTEN_BY").write_text(f"Tiers at commit {commit}, torch {torch.__version__}\n")
        print(name, sorted(p.name for p in directory.rglob("*") if p.is_file()), file=sys.stderr)


if __name__ == "__main__":
    main()
