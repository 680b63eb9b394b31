"""Where this rank sits in each parallelism, under the names a training loop uses.

Note [data-parallel coordinates]
`engine.dp_rank` / `dp_world_size` / `dp_group` are the coordinates a loop shards its data by, in every
layout: the ranks that see different samples (mesh.dp). Under sequence parallelism the S ranks of a group share
each sample, so they are not data-parallel ranks there (DeepSpeed's `dp_world_size` excludes them too),
although gradients are reduced and ZeRO shards over all of them: that wider group is the mesh's zero axis
(DeepSpeed's `seq_data_parallel_group` / `seq_dp_world_size`, engine/compat/deepspeed_names.py). Tensor, pipeline
and expert coordinates have accessors of their own.
"""

from __future__ import annotations

from engine.mesh import Mesh


class ParallelCoordinates:
    """This rank's coordinates, read from `self.mesh` (a mixin of the Engine)."""

    mesh: Mesh

    # ---- data parallel: the ranks that see different samples ----------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh.dp.rank

    @property
    def dp_world_size(self) -> int:
        return self.mesh.dp.size

    @property
    def dp_group(self):
        return self.mesh.dp.group

    # ---- tensor, pipeline, expert --------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.mesh.tp.rank

    @property
    def tp_group(self):
        return self.mesh.tp.group

    @property
    def pp_group(self):
        return self.mesh.pp.group

    @property
    def ep_rank(self) -> int:
        return self.mesh.ep.rank

    @property
    def ep_group(self):
        return self.mesh.ep.group
