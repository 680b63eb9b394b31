"""The run's one device mesh: the config's parallel degrees, checked once, as a named torch DeviceMesh.

Note [one mesh]
world = pp × dp × sp × tp, pipeline outermost and tensor parallelism innermost (as Megatron and torchtitan
lay them out: a tp group is one node's fast links), so global rank = ((p·dp + d)·sp + s)·tp + t.

    pp ─┬─ dp ─┬─ sp ─┬─ tp           (2D tp: tp_r × tp_c, row-major: tp rank = r·q + c)
        │      │      └─ ep ⊂ dp × sp (consecutive dp × sp positions: Note [expert parallelism])
        │      └─ ZeRO group = dp × sp (the ranks holding the same weights: gradients and shards span them)
        └─ samples differ across dp only (Note [data-parallel coordinates])

The mesh is built from *atomic* dimensions, one per factor that some group needs, and every group is a
dimension or a flattened run of adjacent ones (DeviceMesh `_flatten`). Expert parallelism splits dp × sp into
edp × ep with ep innermost: when sp divides ep, dp splits into (edp, ep / sp) and ep = (ep / sp, sp); when ep
divides sp, sp splits into (sp / ep, ep) and edp = (dp, sp / ep). Under 2D tensor parallelism the tp ranks form
a q×q grid of atoms tp_r × tp_c (the row and column coordinates): the axis tp_row holds one row (the q ranks of
one batch block, along tp_c), tp_col one column. 2.5D puts `depth` such grids side by side (atoms tp_d × tp_r ×
tp_c; tp_depth joins the ranks at one grid place); 3D is a q×q×q cube tp_i × tp_j × tp_k, whose tp_col is tp_i
and whose tp_row is the plane tp_j × tp_k (Note [tensor-parallel grids]).
Every dimension is built even at size 1, so that each group exists (a size-1 group, never the world group).
Hybrid sharding (`zero_optimization.mics_shard_size`, Note [hybrid sharding]) splits dp into dp_replicate ×
dp_shard, shard innermost: a shard group (dp_shard × sp, consecutive ZeRO ranks) holds one copy of the sharded
states, and the replicate group joins the ranks holding the same shard in the other copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.grid_shapes import grid_side, tp_grid_problem

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
    tp_mode: str = "1d"  # "1d", "2d", "2.5d" or "3d" (Note [tensor-parallel grids]); tp 1 is always 1d
    tp_depth: int = 1  # 2.5d: the grids side by side
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
        problem = tp_grid_problem(self.tp, self.tp_mode, self.tp_depth)
        if problem:
            raise ValueError(f"tensor_parallel.size {self.tp}: {problem}")

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

    @property
    def tp_grid(self) -> str:
        """The tensor-parallel mode in effect: "1d" whenever tp is 1."""
        return self.tp_mode if self.tp > 1 else "1d"

    @property
    def tp_side(self) -> int:
        """q: the side of the 2D grid (2D, 2.5D) or of the cube (3D); 1 in 1D."""
        return grid_side(self.tp, self.tp_grid, self.tp_depth)

    def tp_atoms(self) -> list[tuple[str, int]]:
        q, grid = self.tp_side, self.tp_grid
        if grid == "2d":
            return [("tp_r", q), ("tp_c", q)]
        if grid == "2.5d":
            return [("tp_d", self.tp_depth), ("tp_r", q), ("tp_c", q)]
        if grid == "3d":
            return [("tp_i", q), ("tp_j", q), ("tp_k", q)]
        return [("tp", self.tp)]

    def atoms(self) -> list[tuple[str, int]]:
        """The mesh's dimensions, outermost first (Note [one mesh])."""
        tp = self.tp_atoms()
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
        tp = tuple(n for n, _ in self.tp_atoms())
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
        grids = {"tp_plane": ("tp_j", "tp_k")} if self.tp_grid == "3d" else {}
        return {"pp": ("pp",), "tp": tp, "zero": zero, **views, **grids}


@dataclass(frozen=True)
class Axis:
    """One named sub-mesh as this rank sees it: its process group, this rank's place in it and its size. The group
    is None where no collective runs over it: one process, or a parallelism that is off (size 1); the ZeRO group
    and the views that fall back to it (dp without sequence parallelism, edp without experts, shard without
    hybrid sharding) are the exception, a group of their own in every multi-process run."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1


@dataclass(frozen=True, eq=False)
class Mesh:
    """The run's DeviceMesh and its named sub-meshes (Note [one mesh]); every parallel process group comes from it.
    Built by `build` (process groups), `single` (one process) or `layout` (sizes only)."""

    dims: ParallelDims | None  # None: a layout of sizes only
    device: torch.device
    world: Axis  # every rank (group None: the default group)
    zero: Axis  # dp × sp: the ranks holding the same dense weights (gradients averaged, states sharded over them)
    dp: Axis  # the ranks that see different samples (Note [data-parallel coordinates])
    shard: Axis  # the ranks ZeRO shards the states over: zero, or one copy of it under hybrid sharding
    replicate: Axis  # the ranks holding this rank's shard in the other copies (size 1 without hybrid sharding)
    edp: Axis  # the ranks holding this rank's experts (zero without expert parallelism)
    pp: Axis
    tp: Axis
    sp: Axis
    ep: Axis
    tp_row: Axis  # 2D/2.5D tensor parallelism: this rank's row (the ranks that differ in column); 3D: its plane
    tp_col: Axis  # 2D/2.5D: its column; 3D: the ranks that differ in i (Note [tensor-parallel grids])
    tp_depth: Axis  # 2.5D: the ranks at this rank's place in the other grids
    tp_j: Axis  # 3D: the ranks that differ in j
    tp_k: Axis  # 3D: the ranks that differ in k
    device_mesh: DeviceMesh | None = None
    control_group: dist.ProcessGroup | None = None  # every rank, gloo, checkpoint control (Note [checkpoint commit])

    GRID_AXES = ("tp_row", "tp_col", "tp_depth", "tp_j", "tp_k")  # 2D, 2.5D, 3D tensor parallelism's own groups
    AXES = ("world", "zero", "dp", "shard", "replicate", "edp", "pp", "tp", "sp", "ep", *GRID_AXES)

    @classmethod
    def build(cls, dims: ParallelDims, device: torch.device | str, *, control: bool = False) -> "Mesh":
        """Every group of `dims` over the running process group (control: also the checkpoint control group)."""
        device = torch.device(device)
        atoms = dims.atoms()
        device_mesh = init_device_mesh(device.type, tuple(s for _, s in atoms),
                                       mesh_dim_names=tuple(n for n, _ in atoms))
        views: dict[str, DeviceMesh] = {}
        for name, span in dims.views().items():  # every rank flattens every view, in the same order
            views[name] = device_mesh[span[0]] if len(span) == 1 else device_mesh[span]._flatten(f"{name}_view")
        control_group = dist.new_group(list(range(dims.world)), backend="gloo") if control else None
        return cls(dims, device, **_axes_of(dims, views, device_mesh), device_mesh=device_mesh,
                   control_group=control_group)

    @classmethod
    def single(cls, device: torch.device | str) -> "Mesh":
        """One process: every axis of size 1, no group."""
        return cls(ParallelDims(1), torch.device(device), **{name: Axis() for name in cls.AXES})

    @classmethod
    def layout(cls, device: torch.device | str = "cpu", *, zero: int = 1, tp: int = 1, pp: int = 1, sp: int = 1,
               ep: int = 1) -> "Mesh":
        """Sizes only, for this rank at place 0 of each (estimates, tables): no groups and no checks."""
        world = zero * tp * pp
        edp = zero // ep if ep > 1 else zero
        sizes = {"world": world, "zero": zero, "dp": zero // sp, "shard": zero, "replicate": 1, "edp": edp,
                 "pp": pp, "tp": tp, "sp": sp, "ep": ep, **dict.fromkeys(cls.GRID_AXES, 1)}
        return cls(None, torch.device(device), **{name: Axis(None, 0, size) for name, size in sizes.items()})

    def sizes(self) -> dict[str, int]:
        """Every axis's size by name."""
        return {name: getattr(self, name).size for name in self.AXES}

    @property
    def in_first_copy(self) -> bool:
        """This rank's ZeRO shards are the first copy's (every rank's, without hybrid sharding): the copy a
        checkpoint records (Note [hybrid sharding])."""
        return self.replicate.rank == 0

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


def _axes_of(dims: ParallelDims, views: dict[str, DeviceMesh], device_mesh: DeviceMesh) -> dict[str, Axis]:
    """Each axis of a built mesh, with the None and fallback rules of `Axis`."""
    def view(name: str, size: int, on: bool | None = None) -> Axis:
        if not (size > 1 if on is None else on):
            return Axis(None, 0, size)
        mesh = views[name] if name in views else device_mesh[name]
        return Axis(mesh.get_group(), mesh.get_local_rank(), size)

    zero = view("zero", dims.dp * dims.sp, on=True)
    shard_size = zero.size // dims.replicas
    axes = {"world": Axis(None, dist.get_rank(), dims.world), "zero": zero,
            "dp": view("dp", dims.dp, on=True) if dims.sp > 1 else zero,
            "shard": view("shard", shard_size, on=True) if dims.replicas > 1 else zero,
            "replicate": Axis(views["replicate"].get_group() if dims.replicas > 1 else None,
                              zero.rank // shard_size, dims.replicas),
            "edp": view("edp", dims.edp, on=True) if dims.ep > 1 else zero}
    for name in ("pp", "tp", "sp", "ep"):
        axes[name] = view(name, getattr(dims, name))
    q, grid = dims.tp_side, dims.tp_grid
    flat = grid in ("2d", "2.5d")  # the atoms are coordinates (row r, column c): a row is the ranks that differ in c
    axes["tp_row"] = view("tp_c", q, on=True) if flat else view("tp_plane", q * q, on=True) if grid == "3d" else Axis()
    axes["tp_col"] = view("tp_r", q, on=True) if flat else view("tp_i", q, on=True) if grid == "3d" else Axis()
    axes["tp_depth"] = view("tp_d", dims.tp_depth, on=True) if grid == "2.5d" else Axis()
    axes["tp_j"] = view("tp_j", q, on=True) if grid == "3d" else Axis()
    axes["tp_k"] = view("tp_k", q, on=True) if grid == "3d" else Axis()
    return axes

