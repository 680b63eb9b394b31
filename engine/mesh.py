"""The run's one device mesh: the config's parallel degrees, checked once, as a named torch DeviceMesh.

Note [one mesh]
world = pp × dp × sp × tp, pipeline outermost and tensor parallelism innermost (as Megatron and torchtitan
lay them out: a tp group is one node's fast links), so global rank = ((p·dp + d)·sp + s)·tp + t.

    pp ─┬─ dp ─┬─ sp ─┬─ tp           (2D tp: tp_row × tp_col, row-major: tp rank = row·q + col)
        │      │      └─ ep ⊂ dp × sp (consecutive dp × sp positions: Note [expert parallelism])
        │      └─ ZeRO group = dp × sp (the ranks holding the same weights: gradients and shards span them)
        └─ samples differ across dp only (Note [data-parallel coordinates])

The mesh is built from *atomic* dimensions, one per factor that some group needs, and every group is a
dimension or a flattened run of adjacent ones (DeviceMesh `_flatten`). Expert parallelism splits dp × sp into
edp × ep with ep innermost: when sp divides ep, dp splits into (edp, ep / sp) and ep = (ep / sp, sp); when ep
divides sp, sp splits into (sp / ep, ep) and edp = (dp, sp / ep). Under 2D tensor parallelism the tp ranks form
a q×q grid: a row group holds one row (the q ranks of one batch block), a column group one column.
Every dimension is built even at size 1, so that each group exists (a size-1 group, never the world group).
Hybrid sharding (`zero_optimization.mics_shard_size`, Note [hybrid sharding]) splits dp into dp_replicate ×
dp_shard, shard innermost: a shard group (dp_shard × sp, consecutive ZeRO ranks) holds one copy of the sharded
states, and the replicate group joins the ranks holding the same shard in the other copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# the config key behind each degree, for errors
DEGREE_KEYS = {"pp": "pipeline.stages", "sp": "sequence_parallel.size", "tp": "tensor_parallel.size",
               "ep": "moe.expert_parallel_size", "shard": "zero_optimization.mics_shard_size"}


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a run, checked against the world size (Note [one mesh])."""

    world: int
    pp: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1
    tp_2d: bool = False
    shard: int = 0  # ranks of dp × sp one ZeRO shard group spans (Note [hybrid sharding]); 0: all of them

    def __post_init__(self):
        for name in ("pp", "sp", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{DEGREE_KEYS[name]} {getattr(self, name)} must be 1 or more")
        model = self.pp * self.sp * self.tp
        if self.world == 1 and max(model, self.ep) > 1:
            name = next(n for n in ("tp", "pp", "sp", "ep") if getattr(self, n) > 1)
            size = getattr(self, name)
            raise ValueError(f"{DEGREE_KEYS[name]} {size} needs {size} processes, and this run has 1; launch with "
                             f"torchrun --nproc_per_node {size} (or a multiple of it)")
        if self.world % model:
            raise ValueError(f"{self._product_text()} must divide the world size {self.world} (world = pp × dp × sp "
                             f"× tp); launch a multiple of {model} processes, or lower a degree")
        if self.ep > 1 and (self.dp * self.sp) % self.ep:
            ranks = self.dp * self.sp
            raise ValueError(f"moe.expert_parallel_size {self.ep} must divide the data-parallel size {ranks} "
                             f"(dp {self.dp} × sequence_parallel.size {self.sp}, the ranks holding the same dense "
                             f"weights); use a size that divides {ranks}, or launch more processes")
        if self.ep > 1 and self.ep % self.sp and self.sp % self.ep:
            raise ValueError(f"moe.expert_parallel_size {self.ep} and sequence_parallel.size {self.sp}: one must "
                             "divide the other (an expert group holds whole sequence groups, or part of one); use "
                             f"sizes such as {self.sp} or {2 * self.sp}")
        self._check_shard()
        if self.tp_2d and (self.tp < 4 or math.isqrt(self.tp) ** 2 != self.tp):
            raise ValueError(f"tensor_parallel.size {self.tp} with mode \"2d\" must be a square q² (4, 9, 16, ...), "
                             "one rank per block of the q×q mesh; use a square size, or mode \"1d\"")

    def _check_shard(self) -> None:
        if not self.shard:
            return
        key, ranks = DEGREE_KEYS["shard"], self.dp * self.sp
        if self.shard < 1 or ranks % self.shard:
            raise ValueError(f"{key} {self.shard} must divide the ZeRO group's {ranks} ranks (data-parallel {self.dp}"
                             f" × sequence_parallel.size {self.sp}); use a divisor of {ranks}, or -1 to shard across "
                             "all of them")
        if self.shard % self.sp:
            raise ValueError(f"{key} {self.shard}: a shard group holds whole sequence-parallel groups; use a multiple "
                             f"of sequence_parallel.size {self.sp}")
        if self.replicas > 1 and self.ep > 1:
            raise ValueError(f"{key} {self.shard} with moe.expert_parallel_size {self.ep}: hybrid sharding with "
                             "expert parallelism is not supported yet; remove mics_shard_size (or set -1)")

    def _product_text(self) -> str:
        used = [f"{DEGREE_KEYS[n]} {getattr(self, n)}" for n in ("pp", "sp", "tp") if getattr(self, n) > 1]
        product = self.pp * self.sp * self.tp
        return used[0] if len(used) == 1 else f"{' × '.join(used)} = {product}"

    @property
    def dp(self) -> int:
        """Ranks that see different samples."""
        return self.world // (self.pp * self.sp * self.tp)

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (dp × sp / ep)."""
        return self.dp * self.sp // self.ep

    @property
    def replicas(self) -> int:
        """Copies of the ZeRO-sharded states (Note [hybrid sharding]): dp × sp / shard; 1 without hybrid sharding."""
        return self.dp * self.sp // self.shard if self.shard else 1

    def atoms(self) -> list[tuple[str, int]]:
        """The mesh's dimensions, outermost first (Note [one mesh])."""
        tp = [("tp_row", math.isqrt(self.tp)), ("tp_col", math.isqrt(self.tp))] if self.tp_2d else [("tp", self.tp)]
        if self.replicas > 1:
            middle = [("dp_replicate", self.replicas), ("dp_shard", self.dp // self.replicas), ("sp", self.sp)]
        elif self.ep == 1:
            middle = [("dp", self.dp), ("sp", self.sp)]
        elif self.ep % self.sp == 0:
            middle = [("edp", self.dp // (self.ep // self.sp)), ("ep_dp", self.ep // self.sp), ("sp", self.sp)]
        else:
            middle = [("dp", self.dp), ("sp_edp", self.sp // self.ep), ("ep", self.ep)]
        return [("pp", self.pp), *middle, *tp]

    def views(self) -> dict[str, tuple[str, ...]]:
        """Each group of the run as the run of adjacent atoms it spans."""
        names = [n for n, _ in self.atoms()]
        tp = ("tp_row", "tp_col") if self.tp_2d else ("tp",)
        zero = tuple(n for n in names if n not in ("pp", *tp))
        if self.replicas > 1:
            views = {"dp": ("dp_replicate", "dp_shard"), "sp": ("sp",), "shard": ("dp_shard", "sp"),
                     "replicate": ("dp_replicate",)}
        elif self.ep == 1:
            views = {"dp": ("dp",), "sp": ("sp",)}
        elif self.ep % self.sp == 0:
            views = {"dp": ("edp", "ep_dp"), "sp": ("sp",), "ep": ("ep_dp", "sp"), "edp": ("edp",)}
        else:
            views = {"dp": ("dp",), "sp": ("sp_edp", "ep"), "ep": ("ep",), "edp": ("dp", "sp_edp")}
        return {"pp": ("pp",), "tp": tp, "zero": zero, **views}


class Mesh:
    """The run's DeviceMesh and its named groups (Note [one mesh]); every parallel process group comes from it."""

    def __init__(self, dims: ParallelDims, device_type: str):
        self.dims = dims
        atoms = dims.atoms()
        self.device_mesh = init_device_mesh(device_type, tuple(s for _, s in atoms),
                                            mesh_dim_names=tuple(n for n, _ in atoms))
        self._views: dict[str, DeviceMesh] = {}
        for name, span in dims.views().items():  # every rank flattens every view, in the same order
            self._views[name] = (self.device_mesh[span[0]] if len(span) == 1
                                 else self.device_mesh[span]._flatten(f"{name}_view"))

    def control_group(self) -> dist.ProcessGroup:
        """Every rank, over gloo, for checkpoint control messages only (Note [checkpoint commit]): a group of its
        own, so that a background save never interleaves its collectives with training's."""
        return dist.new_group(list(range(self.dims.world)), backend="gloo")

    def group(self, name: str) -> dist.ProcessGroup:
        """This rank's group along view `name` (pp, dp, sp, tp, zero, ep, edp; tp_row, tp_col under 2D; shard,
        replicate under hybrid sharding)."""
        mesh = self._views[name] if name in self._views else self.device_mesh[name]
        return mesh.get_group()

    def rank(self, name: str) -> int:
        mesh = self._views[name] if name in self._views else self.device_mesh[name]
        return mesh.get_local_rank()

    def size(self, name: str) -> int:
        mesh = self._views[name] if name in self._views else self.device_mesh[name]
        return mesh.size()

    def subgroup(self, name: str, members: tuple[int, ...]) -> dist.ProcessGroup:
        """The group of positions `members` along atomic dimension `name` at this rank's place in the others (e.g.
        the pipeline stages that share a parameter); every rank builds every such group, in the same order."""
        ranks = self.device_mesh.mesh
        axis = self.device_mesh.mesh_dim_names.index(name)
        rows = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis])[:, list(members)].tolist()
        mine, me = None, dist.get_rank()
        for row in rows:
            group = dist.new_group(row)
            if me in row:
                mine = group
        return mine
