"""Who this process is in the run and which groups it talks over: a Topology, carried explicitly (no module
globals), read off the run's one DeviceMesh (Note [one mesh], engine/mesh.py), which builds every group.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Topology:
    """Who this process is and which groups it reduces over (Note [one mesh])."""

    world_size: int
    rank: int
    dp_group: dist.ProcessGroup | None  # None: the default (world) group
    dp_world_size: int
    dp_rank: int
    device: torch.device
    tp_group: dist.ProcessGroup | None = None  # None: no tensor parallelism (tp_size 1)
    tp_size: int = 1
    tp_rank: int = 0
    tp_row_group: dist.ProcessGroup | None = None  # 2D only: this rank's row of the q×q mesh
    tp_col_group: dist.ProcessGroup | None = None  # 2D only: this rank's column
    # every rank, gloo, for checkpoint control messages only (Note [checkpoint commit]): a group of its own,
    # so a background save never interleaves its collectives with training's; None in one process
    control_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None  # None: no pipeline (pp_size 1)
    pp_size: int = 1
    pp_rank: int = 0
    sp_group: dist.ProcessGroup | None = None  # None: no sequence parallelism (sp_size 1)
    sp_size: int = 1
    sp_rank: int = 0
    # the ranks that see different samples, under sequence parallelism (where dp_group also holds the sp ranks);
    # None: the dp group
    sample_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None  # None: no expert parallelism (ep_size 1)
    ep_size: int = 1
    ep_rank: int = 0
    edp_group: dist.ProcessGroup | None = None  # the ranks holding this rank's experts; None: the dp group
    edp_size: int = 0  # 0: the dp group's size
    edp_rank: int = -1  # -1: the dp rank
    mesh: Mesh | None = None  # None: one process
    # hybrid sharding (Note [hybrid sharding]): the ranks sharing this rank's ZeRO states, a part of dp_group (read
    # through shard_group); and the ranks holding the same shard in the other copies. None, 1: no hybrid sharding
    # (dp_group shards them, and there is no copy to reduce across)
    zero_shard_group: dist.ProcessGroup | None = None
    replica_group: dist.ProcessGroup | None = None
    replica_size: int = 1

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        """The ranks ZeRO shards the model states across: dp_group, or one copy of them under hybrid sharding."""
        return self.zero_shard_group if self.replica_size > 1 else self.dp_group

    @property
    def shard_size(self) -> int:
        """Ranks one copy of the ZeRO states is sharded over (dp × sp, or mics_shard_size of them)."""
        return self.dp_world_size // self.replica_size

    @property
    def in_first_copy(self) -> bool:
        """This rank's ZeRO shards are the first copy's (every rank's, without hybrid sharding): the copy a
        checkpoint records (Note [hybrid sharding])."""
        return self.dp_rank < self.shard_size

    @property
    def shard_rank(self) -> int:
        """This rank's place in its shard group: shard innermost, ZeRO rank = replica · shard_size + shard rank."""
        return self.dp_rank % self.shard_size

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        return self.edp_group if self.ep_size > 1 else self.dp_group

    @property
    def expert_dp_size(self) -> int:
        return self.edp_size if self.ep_size > 1 else self.dp_world_size

    @property
    def expert_dp_rank(self) -> int:
        return self.edp_rank if self.ep_size > 1 else self.dp_rank

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples: the data-parallel ranks less the sequence-parallel ones, which share
        each sample (Note [sequence parallelism])."""
        return self.dp_world_size // self.sp_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's place among the ranks that see different samples (Note [data-parallel coordinates])."""
        return self.dp_rank // self.sp_size

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.sample_group if self.sp_size > 1 else self.dp_group

    @property
    def is_distributed(self) -> bool:
        return self.dp_world_size > 1

    @classmethod
    def from_environment(cls, device: torch.device | None = None, tp_size: int = 1, tp_mode: str = "1d",
                         pp_size: int = 1, sp_size: int = 1, ep_size: int = 1, shard_size: int = 0) -> "Topology":
        """shard_size: ranks of dp × sp one ZeRO shard group spans (Note [hybrid sharding]); 0: all of them."""
        device = device or compute_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # also when the caller created the process group
        init_distributed(device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        dims = ParallelDims(world, pp=pp_size, sp=sp_size, tp=tp_size, ep=ep_size,
                            tp_2d=tp_mode == "2d" and tp_size > 1,
                            shard=shard_size)  # checks every product (Note [one mesh])
        if world == 1:
            return cls(1, 0, None, 1, 0, device)
        return cls.of_mesh(Mesh(dims, device.type), device)

    @classmethod
    def of_mesh(cls, mesh: Mesh, device: torch.device) -> "Topology":
        """This rank's groups and coordinates, each from the mesh (Note [one mesh])."""
        dims, world = mesh.dims, mesh.dims.world
        group = lambda name, size: mesh.group(name) if size > 1 else None  # noqa: E731 (None: no such parallelism)
        rank = lambda name, size: mesh.rank(name) if size > 1 else 0  # noqa: E731
        return cls(world, dist.get_rank(), mesh.group("zero"), dims.dp * dims.sp, mesh.rank("zero"), device,
                   group("tp", dims.tp), dims.tp, rank("tp", dims.tp),
                   tp_row_group=mesh.group("tp_col") if dims.tp_2d else None,  # a row: every column of one row
                   tp_col_group=mesh.group("tp_row") if dims.tp_2d else None,
                   control_group=mesh.control_group(),
                   pp_group=group("pp", dims.pp), pp_size=dims.pp, pp_rank=rank("pp", dims.pp),
                   sp_group=group("sp", dims.sp), sp_size=dims.sp, sp_rank=rank("sp", dims.sp),
                   sample_group=mesh.group("dp") if dims.sp > 1 else None,
                   ep_group=group("ep", dims.ep), ep_size=dims.ep, ep_rank=rank("ep", dims.ep),
                   edp_group=group("edp", dims.ep), edp_size=dims.edp if dims.ep > 1 else 0,
                   edp_rank=rank("edp", dims.ep) if dims.ep > 1 else -1, mesh=mesh,
                   zero_shard_group=group("shard", dims.replicas), replica_group=group("replicate", dims.replicas),
                   replica_size=dims.replicas)
