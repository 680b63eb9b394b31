"""DeepSpeed's names for this rank's coordinates, and Tiers' earlier `topology` view, on the engine: scripts written
for DeepSpeed read them from the engine (`engine.seq_dp_world_size`, `engine.stage_id`) (Note [data-parallel
coordinates])."""

from __future__ import annotations

from engine.compat.topology import Topology
from engine.mesh import Mesh


class DeepSpeedNames:
    """A mixin of the Engine: DeepSpeed's names over `self.mesh`."""

    mesh: Mesh

    @property
    def topology(self) -> Topology:
        """The same facts under Topology's flat names (dp_* there is the ZeRO group: mesh.zero)."""
        return Topology.of_mesh(self.mesh)

    @property
    def data_parallel_group(self):
        return self.mesh.dp.group

    # ---- the group gradients are reduced and ZeRO shards over (data × sequence ranks) ---------------
    @property
    def seq_dp_world_size(self) -> int:
        return self.mesh.zero.size

    @property
    def seq_data_parallel_group(self):
        return self.mesh.zero.group

    # ---- sequence, tensor, pipeline, expert ----------------------------------------------------------
    @property
    def seq_parallel_rank(self) -> int:
        return self.mesh.sp.rank

    @property
    def seq_parallel_world_size(self) -> int:
        return self.mesh.sp.size

    sequence_parallel_size = seq_parallel_world_size

    @property
    def seq_parallel_group(self):
        return self.mesh.sp.group

    @property
    def tp_world_size(self) -> int:
        return self.mesh.tp.size

    @property
    def stage_id(self) -> int:
        """The pipeline stage (DeepSpeed's PipelineEngine name)."""
        return self.mesh.pp.rank

    @property
    def num_stages(self) -> int:
        return self.mesh.pp.size

    @property
    def ep_world_size(self) -> int:
        return self.mesh.ep.size
