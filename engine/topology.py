"""Process groups for the run. Carried explicitly as a Topology object; no module globals.

Note [dp x tp layout]
world = dp × tp, tensor-parallel ranks adjacent (as Megatron and torchtitan lay them out: a tp
group is one node's fast links): global rank = dp_rank * tp + tp_rank. tp group d holds ranks
d*tp .. d*tp + tp - 1; dp group t holds ranks t, t + tp, t + 2tp, ... (the same tp_rank in every
tp group, i.e. the same shard of every tensor-parallel weight). Every rank creates every group,
in the same order (torch.distributed.new_group requires it).

With pipeline parallelism (pp stages) the pipeline is outermost, as in Megatron: world = pp × dp × tp,
global rank = pp_rank * dp * tp + dp_rank * tp + tp_rank; the tp and dp groups above live inside one
pipeline rank's dp × tp ranks, and a pp group holds the pp ranks with the same dp and tp rank.

With sequence parallelism (sp ranks share each sample), world = dp × sp × tp, tp innermost and then sp:
global rank = (dp_rank' * sp + sp_rank) * tp + tp_rank; the dp group of a tp rank holds its dp × sp ranks
(dp_world_size = dp × sp, dp_rank = rank // tp), an sp group the sp ranks with the same dp and tp rank.

With expert parallelism (Note [expert parallelism]) the data-parallel ranks split into ep × edp, ep innermost
(DeepSpeed's layout): an ep group holds ep consecutive data-parallel ranks, which hold different experts and
exchange tokens; an expert-data-parallel (edp) group holds the ranks with the same ep rank, which hold the same
experts and reduce their gradients and ZeRO shards. Dense parameters still span the whole data-parallel group.

Under 2D tensor parallelism (tp = q²) the tp group is a q×q mesh, row-major: tp rank t sits at row
t // q, column t % q. A row group holds the q ranks of one row (one batch block, every hidden
block), a column group the q ranks of one column (one hidden block, every batch block).
"""

from __future__ import annotations

import dataclasses
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
    """Who this process is and which groups it reduces over (Note [dp x tp layout])."""

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

    def global_rank(self, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None) -> int:
        """The global rank at (pp_rank, dp_rank, tp_rank); this rank's dp and tp rank by default."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        return (pp_rank * self.dp_world_size + dp_rank) * self.tp_size + tp_rank

    @classmethod
    def from_environment(cls, device: torch.device | None = None, tp_size: int = 1, tp_mode: str = "1d",
                         pp_size: int = 1, sp_size: int = 1, ep_size: int = 1) -> "Topology":
        device = device or compute_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # also when the caller created the process group
        init_distributed(device)
        if not dist.is_initialized():
            if tp_size != 1:
                raise ValueError(f"tensor_parallel.size {tp_size} needs {tp_size} processes (one per shard), and this "
                                 f"run has 1; launch with torchrun --nproc_per_node {tp_size} (or a multiple of it)")
            for key, size in (("pipeline.stages", pp_size), ("sequence_parallel.size", sp_size),
                              ("moe.expert_parallel_size", ep_size)):
                if size != 1:
                    raise ValueError(f"{key} {size} needs {size} processes, and this run has 1; launch with torchrun "
                                     f"--nproc_per_node {size} (or a multiple of it)")
            return cls(1, 0, None, 1, 0, device)
        world, rank = dist.get_world_size(), dist.get_rank()
        if sp_size > 1:
            topology = cls._with_sequence_parallel(world, rank, device, sp_size, tp_size)
        elif pp_size > 1:
            topology = cls._with_pipeline(world, rank, device, tp_size, pp_size)
        elif tp_size == 1:
            topology = cls(world, rank, None, world, rank, device)
        else:
            topology = cls._with_tensor_parallel(world, rank, device, tp_size)
            topology = topology._with_mesh() if tp_mode == "2d" else topology
        if ep_size > 1:
            topology = topology._with_experts(ep_size)
        control = dist.new_group(list(range(world)), backend="gloo") if world > 1 else None
        return dataclasses.replace(topology, control_group=control)

    @classmethod
    def _with_tensor_parallel(cls, world: int, rank: int, device: torch.device, tp: int) -> "Topology":
        if world % tp:
            raise ValueError(f"tensor_parallel.size {tp} must divide the world size {world} (world = dp × tp); "
                             f"use a size that divides {world}, or launch a multiple of {tp} processes")
        dp = world // tp
        tp_group = dp_group = None
        for d in range(dp):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(d * tp, (d + 1) * tp)))
            if rank // tp == d:
                tp_group = group
        for t in range(tp):
            group = dist.new_group(list(range(t, world, tp)))  # size 1 when dp = 1: never the world group
            if rank % tp == t:
                dp_group = group
        return cls(world, rank, dp_group, dp, rank // tp, device, tp_group, tp, rank % tp)

    @classmethod
    def _with_sequence_parallel(cls, world: int, rank: int, device: torch.device, sp: int,
                                tp: int = 1) -> "Topology":
        """Note [sequence parallelism]: world = dp × sp × tp, tp innermost, then the sp ranks of one sample
        (rank = (d·sp + s)·tp + t). The ranks of one tp rank hold the same weights, so gradients and ZeRO shards
        span their dp × sp ranks (all ranks without tensor parallelism)."""
        if world % (sp * tp):
            raise ValueError(f"sequence_parallel.size {sp} × tensor_parallel.size {tp} must divide the world size "
                             f"{world} (world = dp × sp × tp); launch a multiple of {sp * tp} processes")
        tp_group = sp_group = dp_group = sample_group = None
        dp = world // (sp * tp)
        for d in range(dp):  # every rank creates every group, in the same order
            for t in range(tp):
                group = dist.new_group([(d * sp + s) * tp + t for s in range(sp)])
                if rank // (sp * tp) == d and rank % tp == t:
                    sp_group = group
        for s in range(sp):  # the ranks of one sequence part (and tp rank) across the samples
            for t in range(tp):
                group = dist.new_group([(d * sp + s) * tp + t for d in range(dp)])
                if rank // tp % sp == s and rank % tp == t:
                    sample_group = group
        if tp > 1:
            for x in range(world // tp):
                group = dist.new_group(list(range(x * tp, (x + 1) * tp)))
                if rank // tp == x:
                    tp_group = group
            for t in range(tp):
                group = dist.new_group(list(range(t, world, tp)))
                if rank % tp == t:
                    dp_group = group
        return cls(world, rank, dp_group, world // tp, rank // tp, device, tp_group, tp, rank % tp,
                   sp_group=sp_group, sp_size=sp, sp_rank=rank // tp % sp, sample_group=sample_group)

    @classmethod
    def _with_pipeline(cls, world: int, rank: int, device: torch.device, tp: int, pp: int) -> "Topology":
        """Note [dp x tp layout], pipeline outermost: every group of the pp × dp × tp grid."""
        if world % (pp * tp):
            raise ValueError(f"pipeline.stages {pp} × tensor_parallel.size {tp} must divide the world size {world} "
                             f"(world = pp × dp × tp); launch a multiple of {pp * tp} processes")
        dp = world // (pp * tp)
        pp_rank, dp_rank, tp_rank = rank // (dp * tp), rank // tp % dp, rank % tp
        at = lambda p, d, t: (p * dp + d) * tp + t  # noqa: E731
        mine = {}
        for p in range(pp):  # every rank creates every group, in the same order
            for d in range(dp):
                mine.setdefault("tp", {})[(p, d)] = dist.new_group([at(p, d, t) for t in range(tp)])
            for t in range(tp):
                mine.setdefault("dp", {})[(p, t)] = dist.new_group([at(p, d, t) for d in range(dp)])
        for d in range(dp):
            for t in range(tp):
                mine.setdefault("pp", {})[(d, t)] = dist.new_group([at(p, d, t) for p in range(pp)])
        return cls(world, rank, mine["dp"][(pp_rank, tp_rank)], dp, dp_rank, device,
                   mine["tp"][(pp_rank, dp_rank)] if tp > 1 else None, tp, tp_rank,
                   pp_group=mine["pp"][(dp_rank, tp_rank)], pp_size=pp, pp_rank=pp_rank)

    def _with_experts(self, ep: int) -> "Topology":
        """Note [dp x tp layout], expert parallelism: the ep and edp groups inside the data-parallel group."""
        if self.tp_size > 1 or self.pp_size > 1 or self.sp_size > 1:
            raise ValueError(f"moe.expert_parallel_size {ep} together with tensor, pipeline or sequence parallelism is "
                             "not built yet; use expert parallelism with data parallelism only")
        world = self.world_size
        if world % ep:
            raise ValueError(f"moe.expert_parallel_size {ep} must divide the data-parallel size {world} "
                             f"(dp = ep × edp); use a size that divides {world}, or launch a multiple of {ep} "
                             "processes")
        ep_group = edp_group = None
        for e in range(world // ep):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(e * ep, (e + 1) * ep)))
            if self.rank // ep == e:
                ep_group = group
        for r in range(ep):
            group = dist.new_group(list(range(r, world, ep)))  # size 1 when ep = dp: never the world group
            if self.rank % ep == r:
                edp_group = group
        return dataclasses.replace(self, ep_group=ep_group, ep_size=ep, ep_rank=self.rank % ep, edp_group=edp_group,
                                   edp_size=world // ep, edp_rank=self.rank // ep)

    def _with_mesh(self) -> "Topology":
        """This topology with the row and column groups of every tp group's q×q mesh."""
        q = math.isqrt(self.tp_size)
        if q * q != self.tp_size or q < 2:
            raise ValueError(f"tensor_parallel.size {self.tp_size} with mode \"2d\" "
                             "must be a square q² (4, 9, 16, ...), "
                             "one rank per block of the q×q mesh; use a square size, or mode \"1d\"")
        row_group = col_group = None
        _, mesh_row, mesh_col = mesh_position(self.tp_rank, self.tp_size)
        for d in range(self.dp_world_size):  # every rank creates every group, in the same order
            first = d * self.tp_size
            for i in range(q):
                rows = dist.new_group([first + i * q + j for j in range(q)])
                cols = dist.new_group([first + j * q + i for j in range(q)])
                if self.dp_rank == d and mesh_row == i:
                    row_group = rows
                if self.dp_rank == d and mesh_col == i:
                    col_group = cols
        return dataclasses.replace(self, tp_row_group=row_group, tp_col_group=col_group)
