"""Where this rank sits in each parallelism, under the names a training loop uses.

Note [data-parallel coordinates]
`engine.dp_rank` / `dp_world_size` / `dp_group` are the coordinates a loop shards its data by, in every
layout: the ranks that see different samples. Under sequence parallelism the S ranks of a group share
each sample, so they are not data-parallel ranks there (DeepSpeed's `dp_world_size` excludes them too),
although gradients are reduced and ZeRO shards over all of them: that wider group is
`seq_data_parallel_group` / `seq_dp_world_size` (the topology's dp_group). Sequence, tensor, pipeline and
expert coordinates have accessors of their own, with DeepSpeed's names where it has them.
"""

from __future__ import annotations

from engine.topology import Topology


class ParallelCoordinates:
    """This rank's coordinates, read from `self.topology` (a mixin of the Engine)."""

    topology: Topology

    # ---- data parallel: the ranks that see different samples ----------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.topology.data_parallel_rank

    @property
    def dp_world_size(self) -> int:
        return self.topology.data_parallel_size

    @property
    def dp_group(self):
        return self.topology.data_parallel_group

    data_parallel_group = dp_group

    # ---- the group gradients are reduced and ZeRO shards over (data × sequence ranks) ---------------
    @property
    def seq_dp_world_size(self) -> int:
        return self.topology.dp_world_size

    @property
    def seq_data_parallel_group(self):
        return self.topology.dp_group

    # ---- sequence, tensor, pipeline, expert ----------------------------------------------------------
    @property
    def seq_parallel_rank(self) -> int:
        return self.topology.sp_rank

    @property
    def seq_parallel_world_size(self) -> int:
        return self.topology.sp_size

    sequence_parallel_size = seq_parallel_world_size

    @property
    def seq_parallel_group(self):
        return self.topology.sp_group

    @property
    def tp_rank(self) -> int:
        return self.topology.tp_rank

    @property
    def tp_world_size(self) -> int:
        return self.topology.tp_size

    @property
    def tp_group(self):
        return self.topology.tp_group

    @property
    def stage_id(self) -> int:
        """The pipeline stage (DeepSpeed's PipelineEngine name)."""
        return self.topology.pp_rank

    @property
    def num_stages(self) -> int:
        return self.topology.pp_size

    @property
    def pp_group(self):
        return self.topology.pp_group

    @property
    def ep_rank(self) -> int:
        return self.topology.ep_rank

    @property
    def ep_world_size(self) -> int:
        return self.topology.ep_size

    @property
    def ep_group(self):
        return self.topology.ep_group
