"""Starting this process in the run: its compute device, the process group from torchrun's environment, and the
run's one mesh (Note [one mesh], engine/mesh.py), which builds every group and is carried explicitly (no module
globals).
"""

from __future__ import annotations

import datetime
import math
import os
import socket

import torch
import torch.distributed as dist

# Imported before any process group starts, for its side effect: torch.distributed.nn.functional binds `group.WORLD`
# as a default argument when first imported, and torch imports it lazily (torch.optim.Optimizer -> torch._dynamo ->
# fsdp -> _shard). Imported after init_process_group, it would hold the world group past destroy_process_group until
# interpreter shutdown, where gloo's worker threads can abort the process ("terminate called without an active
# exception", seen once in CI). Imported now, it binds None. tests/test_shutdown.py shows it.
import torch.distributed.nn.functional  # noqa: F401

from engine.mesh import Mesh, ParallelDims
from engine.process_exit import destroy_group_at_exit


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it), for a local job's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    _check_restartable()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    destroy_group_at_exit()  # Note [shutting down at exit]


def _check_restartable() -> None:
    """torchrun --max-restarts with the workers sharing the rendezvous store (torch's default): a restarted worker
    may read the previous attempt's addresses from it and hang or fail in init_process_group (seen here with torch
    2.13; pytorch/pytorch#135712). Refused at the first attempt, with the fix, rather than hanging at a restart."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(
            f"torchrun --max-restarts {restarts} with the workers sharing torchrun's rendezvous store: a restarted "
            "worker can read the previous attempt's addresses from it and hang in init_process_group "
            "(pytorch/pytorch#135712); start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment "
            "(`tiers launch` sets it), or without --max-restarts")


def mesh_position(tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """(q, row, column) of tp rank `tp_rank` on the row-major q×q mesh of a tp group of q² ranks."""
    q = math.isqrt(tp_size)
    row, col = divmod(tp_rank, q)
    return q, row, col


def start_mesh(device: torch.device | None = None, tp_size: int = 1, tp_mode: str = "1d", pp_size: int = 1,
               sp_size: int = 1, ep_size: int = 1, shard_size: int = 0, tp_depth: int = 1) -> Mesh:
    """This process's mesh: the device chosen and the process group started (from torchrun's environment) if they
    are not yet, the degrees checked against the world (Note [one mesh]). shard_size: ranks of dp × sp one ZeRO
    shard group spans (Note [hybrid sharding]); 0: all of them."""
    device = device or compute_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # also when the caller created the process group
    init_distributed(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims(world, pp=pp_size, sp=sp_size, tp=tp_size, ep=ep_size, tp_mode=tp_mode, tp_depth=tp_depth,
                        shard=shard_size)  # checks every product
    return Mesh.single(device) if world == 1 else Mesh.build(dims, device, control=True)
