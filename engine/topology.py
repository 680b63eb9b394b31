"""Process groups for the run. Carried explicitly as a Topology object; no module globals.

Only data parallelism exists so far: dp = world. Tensor parallelism will add tp groups here.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def compute_device() -> torch.device:
    """CUDA when present (this process's LOCAL_RANK), else CPU."""
    if torch.cuda.is_available():
        local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(f"LOCAL_RANK={local_rank} but this node has {count} CUDA device(s); start at most "
                               f"{count} processes per node (torchrun --nproc_per_node {count})")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> None:
    """Starts torch.distributed from torchrun's environment when WORLD_SIZE > 1 (gloo on CPU, nccl on CUDA)."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} not set; start the job with torchrun "
            "or `tiers launch`, or call torch.distributed.init_process_group yourself before initialize()."
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class Topology:
    """Who this process is and which group it reduces gradients over."""

    world_size: int
    rank: int
    dp_group: dist.ProcessGroup | None  # None: the default (world) group
    dp_world_size: int
    dp_rank: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.dp_world_size > 1

    @classmethod
    def from_environment(cls, device: torch.device | None = None) -> "Topology":
        device = device or compute_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # also when the caller created the process group
        init_distributed(device)
        if not dist.is_initialized():
            return cls(1, 0, None, 1, 0, device)
        world, rank = dist.get_world_size(), dist.get_rank()
        return cls(world, rank, None, world, rank, device)
