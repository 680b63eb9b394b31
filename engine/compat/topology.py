"""Tiers' earlier `Topology`: this rank's facts under flat names, read off the mesh. Kept for code written against
it (`engine.topology.tp_size`); new code reads the mesh's axes (Note [one mesh]). Its dp_* name the ZeRO group
(mesh.zero), and data_parallel_* the ranks that see different samples (mesh.dp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.mesh import Mesh
from engine.topology import start_mesh


@dataclass(frozen=True)
class Topology:
    """Who this process is and which groups it reduces over, under flat names (Note [one mesh])."""

    world_size: int
    rank: int
    dp_group: dist.ProcessGroup | None  # None: the default (world) group
    dp_world_size: int
    dp_rank: int
    device: torch.device
    tp_group: dist.ProcessGroup | None = None  # None: no tensor parallelism (tp_size 1)
    tp_size: int = 1
    tp_rank: int = 0
    tp_row_group: dist.ProcessGroup | None = None  # 2D, 2.5D: this rank's row of its q×q mesh; 3D: its plane
    tp_col_group: dist.ProcessGroup | None = None  # 2D, 2.5D: this rank's column; 3D: its i axis
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
                         pp_size: int = 1, sp_size: int = 1, ep_size: int = 1, shard_size: int = 0,
                         tp_depth: int = 1) -> "Topology":
        return cls.of_mesh(start_mesh(device, tp_size, tp_mode, pp_size, sp_size, ep_size, shard_size, tp_depth))

    @classmethod
    def of_mesh(cls, mesh: Mesh) -> "Topology":
        """This rank's groups and coordinates, each from the mesh (Note [one mesh])."""
        zero, edp, ep = mesh.zero, mesh.edp, mesh.ep
        return cls(mesh.world.size, mesh.world.rank, zero.group, zero.size, zero.rank, mesh.device,
                   mesh.tp.group, mesh.tp.size, mesh.tp.rank, tp_row_group=mesh.tp_row.group,
                   tp_col_group=mesh.tp_col.group, control_group=mesh.control_group,
                   pp_group=mesh.pp.group, pp_size=mesh.pp.size, pp_rank=mesh.pp.rank,
                   sp_group=mesh.sp.group, sp_size=mesh.sp.size, sp_rank=mesh.sp.rank,
                   sample_group=mesh.dp.group if mesh.sp.size > 1 else None,
                   ep_group=ep.group, ep_size=ep.size, ep_rank=ep.rank,
                   edp_group=edp.group if ep.size > 1 else None, edp_size=edp.size if ep.size > 1 else 0,
                   edp_rank=edp.rank if ep.size > 1 else -1, mesh=mesh,
                   zero_shard_group=mesh.shard.group if mesh.replicate.size > 1 else None,
                   replica_group=mesh.replicate.group, replica_size=mesh.replicate.size)
