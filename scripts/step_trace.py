"""Which files of engine/ and offload/ one training step runs code in, and how often control comes back to
engine/engine.py from another file: a measure of how far one step's logic is spread out.

Two ranks on 127.0.0.1 train the tiny example GPT under ZeRO stage 3 with parameters and optimizer states on
NVMe (files in a temporary directory); after one warm-up step, rank 0 profiles the calls of its next step
(forward, backward, step; this thread only, so NVMe worker threads are not counted).

    .venv/bin/python scripts/step_trace.py
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engine.topology import free_port  # noqa: E402  (the repository root is on the path only from here)

TRACED = ("engine/", "offload/")
ENGINE_PY = "engine/engine.py"


def _config(swap: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "gradient_clipping": 1.0, "steps_per_print": 10**6, "aio": {"block_size": 4096},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": swap},
                                  "offload_param": {"device": "nvme", "nvme_path": swap}}}


def _relative(path: str) -> str | None:
    """The path inside the repository of a traced source file (engine/ or offload/, not the example model)."""
    if not path.startswith(ROOT):
        return None
    rel = os.path.relpath(path, ROOT)
    return rel if rel.startswith(TRACED) and not rel.startswith("engine/models/") else None


def _worker(rank: int, world: int, port: int, swap: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from engine import initialize
    from engine.models import gpt_from_preset

    torch.manual_seed(0)
    model_engine = initialize(gpt_from_preset("tiny"), _config(swap))
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model_engine.backward(model_engine(x, x))
        model_engine.step()

    step()  # warm-up: the chunk manager records its trace
    calls: collections.Counter = collections.Counter()
    returns = 0

    def profile(frame, event, arg) -> None:
        nonlocal returns
        rel = _relative(frame.f_code.co_filename)
        if rel is None:
            return
        if event == "call":
            calls[rel] += 1
        elif event == "return" and rel != ENGINE_PY and frame.f_back is not None:
            returns += _relative(frame.f_back.f_code.co_filename) == ENGINE_PY

    sys.setprofile(profile)
    step()
    sys.setprofile(None)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"files: {len(calls)}\nreturns to {ENGINE_PY}: {returns}\ncalls per file:\n")
            f.writelines(f"  {name} {n}\n" for name, n in sorted(calls.items()))
    model_engine.close()
    model_engine = None
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as swap:
        out = os.path.join(swap, "report.txt")
        mp.spawn(_worker, args=(2, free_port(), swap, out), nprocs=2)
        with open(out) as f:
            print(f.read(), end="")


if __name__ == "__main__":
    main()
