"""deepspeed.comm: a thin alias of torch.distributed (Tiers runs on it)."""

from __future__ import annotations

import torch.distributed as _dist
from torch.distributed import (  # noqa: F401
    ReduceOp,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    get_rank,
    get_world_size,
    is_initialized,
    new_group,
    reduce,
)

from engine.compat.deepspeed.unsupported import refuse


def init_distributed(dist_backend: str | None = None, **kwargs) -> None:
    from engine.compat.deepspeed.launch import init_distributed as start

    start(dist_backend, **kwargs)


def get_local_rank() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", "0"))


def has_all_gather_into_tensor() -> bool:
    return hasattr(_dist, "all_gather_into_tensor")


def has_reduce_scatter_tensor() -> bool:
    return hasattr(_dist, "reduce_scatter_tensor")


def __getattr__(name: str):
    if hasattr(_dist, name):
        return getattr(_dist, name)
    refuse(f"deepspeed.comm.{name}", "torch.distributed")
