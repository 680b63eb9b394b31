"""Tensor parallelism as a feature (Note [feature objects]): the config's plan replaces the model's layers; every tp
rank's shards join into whole weights; its random streams are replayed by a checkpointed block's recompute."""

from __future__ import annotations

import torch
from torch import nn

from engine.comm import Collectives, CommCounter, broadcast_from
from engine.config_sections import Config
from engine.features import BuildContext, Feature, Features, RecomputeParts
from engine.mesh import Mesh
from engine.tensor_parallel import Mesh2D, TensorParallel, TPGroup, apply_tensor_parallel
from engine.tensor_parallel.mappings_3d import Mesh3D
from engine.tensor_parallel.rng import RNGStreams


def parallelize_tensors(model: nn.Module, cfg: Config, mesh: Mesh,
                        collectives: Collectives | None = None) -> TensorParallel | None:
    """Note [tensor-parallel plans]: the config's plan applied to the model, before its parameters are chunked;
    None without tensor parallelism. collectives: as initialize's."""
    if mesh.tp.size == 1:
        return None
    counter = CommCounter(collectives=collectives) if collectives is not None else CommCounter()
    tp = TPGroup(mesh.tp.group, mesh.tp.size, mesh.tp.rank, counter)
    with torch.no_grad():  # the plan slices whole weights: every tp rank starts from its group's first rank's
        for t in list(model.parameters()) + list(model.buffers()):
            broadcast_from(t.data, 0, tp.group, tp.counter)
    return apply_tensor_parallel(model, cfg.tensor_parallel.plan, tp, RNGStreams(tp, mesh.device),
                                 grid_of(tp, mesh, cfg.tensor_parallel.mode), cfg.tensor_parallel.sequence_parallel)


def grid_of(tp: TPGroup, mesh: Mesh, mode: str) -> Mesh2D | Mesh3D | None:
    """The tp group's grid in `mode` from the mesh's axes (Note [tensor-parallel grids]); None in 1D."""
    if mode in ("2d", "2.5d"):
        return Mesh2D.of(tp, mesh.tp_row.group, mesh.tp_col.group, mesh.tp_depth.group, mesh.tp_depth.size)
    if mode == "3d":
        return Mesh3D.of(tp, {"plane": mesh.tp_row.group, "i": mesh.tp_col.group, "j": mesh.tp_j.group,
                              "k": mesh.tp_k.group})
    return None


class TensorParallelFeature(Feature):
    """Note [tensor-parallel plans]: every tp rank's shards join into whole weights."""

    name, joins_state_dict, rebuilds_parameters = "tensor_parallel", True, True

    def __init__(self, ctx: BuildContext):
        self.ctx, self.device = ctx, ctx.mesh.device
        self.parallel: TensorParallel | None = None

    @classmethod
    def configured(cls, ctx: BuildContext) -> TensorParallelFeature | None:
        return cls(ctx) if ctx.mesh.tp.size > 1 else None

    def build(self, model: nn.Module, before: Features) -> bool:
        self.parallel = parallelize_tensors(model, self.ctx.cfg, self.ctx.mesh, self.ctx.comm.collectives)
        return True

    def cut_names(self) -> frozenset[str]:
        return frozenset(self.parallel.specs)

    def recompute(self, parts: RecomputeParts) -> RecomputeParts:
        return parts.replace(streams=self.parallel.streams, partition_group=self.parallel.tp)

    def norm_weights(self, weights: dict[int, float], model: nn.Module, chunked) -> dict[int, float]:
        """A parameter every tp rank holds whole counts once over them."""
        shares = self.parallel.norm_weights(model)
        return {pid: weights.get(pid, 1.0) * shares.get(pid, 1.0) for pid in weights.keys() | shares.keys()}

    def join_state_dict(self, whole: dict, keep: bool) -> dict:
        return self.parallel.join_state_dict(whole, self.device)

    def place(self, placed, tensors):
        tp, specs = self.parallel.tp, self.parallel.specs
        return {name: p.with_cut(specs.get(name), tp.rank, tp.size) for name, p in placed.items()}

    def layout(self) -> dict:
        return {"tp_mode": self.parallel.mesh.mode if self.parallel.mesh is not None else "1d"}

    def generators(self) -> list:
        return [self.parallel.streams] if self.parallel.streams is not None else []
