"""Tensor parallelism applied to an unmodified model (Note [tensor-parallel plans]).

Note [global norm under tensor parallelism]
The global gradient norm sums every parameter's squared gradient once. A tensor-parallel shard is
a disjoint part of its parameter, so its squares are summed over the tp ranks; a replicated
parameter (layer norms, biases after a row-parallel layer, position embeddings) has the same
gradient on every tp rank, so each rank counts it with weight 1/tp before the same sum. Under 2.5D
every piece is held by each of the `depth` grids, with the same (summed) gradient: weight 1/depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.comm import all_gather_into
from engine.tensor_parallel.layers_2d import Grid
from engine.tensor_parallel.loss_2d import cross_entropy_2d
from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.mappings_2d import Mesh2D, batch_parts
from engine.tensor_parallel.mappings_3d import Mesh3D
from engine.tensor_parallel.plans import apply_plan, resolve_plan
from engine.tensor_parallel.rng import RNGStreams
from engine.tensor_parallel.sequence_1d import SequenceShards
from engine.tensor_parallel.shards import Spec
from engine.tensor_parallel.vocab_cross_entropy import vocab_parallel_cross_entropy

__all__ = ["Mesh2D", "Mesh3D", "TensorParallel", "TPGroup", "apply_tensor_parallel", "cross_entropy_2d",
           "vocab_parallel_cross_entropy"]


@dataclass
class TensorParallel:
    """What the plan did: the tp group and how each sharded parameter (by state-dict name) reassembles."""

    tp: TPGroup
    specs: dict[str, Spec]
    streams: RNGStreams | None = None  # Note [tensor-parallel RNG]
    tied: dict[str, str] = field(default_factory=dict)  # name -> the first name of the same (tied) parameter
    mesh: Grid | None = None  # 2D, 2.5D, 3D (Note [2D tensor parallelism], [tensor-parallel grids])
    sequence: SequenceShards | None = None  # 1D with sequence_parallel (Note [Megatron sequence parallelism])

    def norm_weights(self, model: nn.Module) -> dict[int, float]:
        """id(parameter) -> its weight in the squared global norm (Note [global norm under tensor parallelism])."""
        sharded = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in self.specs}
        replicas = self.mesh.replicas.size if self.mesh is not None and self.mesh.replicas is not None else 1
        return {id(p): 1.0 / replicas if id(p) in sharded else 1.0 / self.tp.size for p in model.parameters()}

    def join_state_dict(self, local: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """Every rank's shards joined into whole tensors, gathered through `device` (a collective over the tp
        group: every tp rank calls it)."""
        out = dict(local)
        for key, spec in self.specs.items():
            if key not in local or self.tied.get(key) in local:  # a tied weight is gathered once, as its first
                continue
            shard = local[key].to(device, copy=True)  # one tensor at a time through the device (nccl)
            gathered = torch.empty((self.tp.size,) + tuple(shard.shape), dtype=shard.dtype, device=device)
            all_gather_into(gathered.view(-1), shard.view(-1), self.tp.group, self.tp.counter, async_op=False)
            out[key] = spec.join(list(gathered.unbind(0))).to(local[key].device)
        for key, first in self.tied.items():  # (a pipeline stage may hold it under its later name only)
            if key in local and first in local:
                out[key] = out[first]
        return out

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy of the whole batch's `target`: in 1D over vocabulary-split logits (a "colwise"
        lm_head, see vocab_cross_entropy); in 2D over this rank's batch block of whole-vocabulary logits (a
        "classifier_2d" lm_head, see loss_2d)."""
        if self.mesh is not None:
            return cross_entropy_2d(logits, target, self.mesh, ignore_index)
        return vocab_parallel_cross_entropy(logits, target, self.tp, ignore_index)


def apply_tensor_parallel(model: nn.Module, plan: str | dict, tp: TPGroup, streams: RNGStreams | None = None,
                          mesh: Grid | None = None, sequence_parallel: bool = False) -> TensorParallel:
    """Replaces the model's layers by the plan's parallel layers, in place (Note [tensor-parallel plans]); with
    `streams`, dropout in the plan's split regions draws per-rank masks (Note [tensor-parallel RNG]). With
    `mesh` the plan is a 2D one, run on that grid (Note [2D tensor parallelism], [tensor-parallel grids]); with
    `sequence_parallel` a 1D plan also splits the activations between its regions along the sequence (Note
    [Megatron sequence parallelism])."""
    sequence = SequenceShards(tp) if sequence_parallel else None
    resolved = resolve_plan(model, plan, "1d", tp.size) if mesh is None else \
        resolve_plan(model, plan, "2d", mesh.width, batch_parts(mesh))
    specs = apply_plan(model, resolved, tp, streams, mesh, sequence)
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):  # in model order: the first name comes first
        if name in specs and first.setdefault(id(p), name) != name:
            tied[name] = first[id(p)]
    return TensorParallel(tp, specs, streams, tied, mesh, sequence)
