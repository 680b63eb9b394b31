"""Before an update: unscale the gradients, take their global norm, clip by it, detect fp16 overflow.

Note [global norm, unscaling and clipping]
The norm is taken per parameter and then over those norms, as torch's clip_grad_norm_ does: one fp32
reduction over a whole multi-million-element chunk loses ~1e-5 of relative accuracy. Where a rank
holds only a shard of each gradient (ZeRO stage >= 1, or tensor parallelism), each rank sums its
pieces' squares and the sums are added over the groups (Note [global norm under tensor
parallelism]); under a pipeline, over the stages too. The norm costs a pass over every gradient, so
it is taken only when clipping, an fp16 overflow check or TensorBoard uses it. Gradients the chunk
manager holds (Note [offloaded gradient shards]) are read one shard at a time for the norm (widened
to fp32 and unscaled first, as in memory); their unscaling and clipping become two factors the
offloaded optimizer applies as it steps each shard (torch's fused Adam: as one grad_scale, Note [one
gradient factor], as in memory; others: in turn, as in memory), so the result equals the in-memory
path's. bf16/fp32 never overflow: as in DeepSpeed the update proceeds (and shows the NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.comm import CommCounter, all_reduce_sum
from engine.mesh import Mesh
from engine.zero.chunk_norms import piece_norms, square_sum_of_norms
from engine.zero.chunked_params import ChunkedParams


@dataclass(frozen=True)
class GradStats:
    """What preparing the gradients found: the global norm before clipping (None when nothing needed it),
    whether an fp16 step overflowed, and the factor an offloaded optimizer multiplies streamed gradients by."""

    norm: float | None
    overflow: bool = False
    streamed_scale: tuple[float, ...] = ()  # the unscaling, then the clipping: what the optimizer applies


class GradientClipper:
    """Unscales, measures and clips the gradients the optimizer steps (Note [global norm, unscaling and clipping])."""

    def __init__(self, chunked: ChunkedParams, mesh: Mesh, comm: CommCounter, clip: float,
                 checks_overflow: bool, norm_logged: bool):
        self.chunked, self.mesh, self.comm = chunked, mesh, comm
        self.clip = clip
        self.checks_overflow = checks_overflow
        self.needs_norm = clip > 0 or checks_overflow or norm_logged

    def prepare(self, loss_scale: float, early_square: torch.Tensor | None = None,
                staged_factor: float = 1.0, factored_norms=None) -> GradStats:
        """early_square: the squared norm summed while shards were stepped in backward (Note [stepping in
        backward]); those shards are updated already, so nothing is clipped. staged_factor: what the fp32 master
        gradients were multiplied by after they were staged from their 16-bit sources (Note [optimizers that
        communicate]). factored_norms: where the optimizer applies the unscaling and clipping factors as it steps
        (Note [the host step in tiles], Note [one gradient factor]), what measures the gradients' norms, given the
        unscaling: the gradients are left as they are and the factors are returned."""
        if self.chunked.grads_managed:
            return self._prepare_streamed(loss_scale, early_square)
        if factored_norms is not None:
            return self._prepare_streamed(loss_scale, None, factored_norms)
        grads = self.chunked.grad_shards()  # what the optimizer reads: the reduced shards
        if loss_scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        if not self.needs_norm:
            return GradStats(None)
        if self.chunked.has_masters:  # the 16-bit gradients, as the offloaded step measures them
            measured = self.chunked.master_grad_norms(staged_factor / loss_scale)
        else:
            measured = piece_norms(self.chunked.grad_norm_pieces())
        stats, coef = self._clipped(self._total(*measured))
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        return stats

    def _total(self, norms: torch.Tensor, weights: torch.Tensor) -> float:
        """The global norm from this rank's per-piece norms and their weights."""
        if not self.chunked.sharded and not self.chunked.has_experts and self.mesh.tp.size == 1 \
                and self.mesh.pp.size == 1:
            return torch.linalg.vector_norm(norms, 2.0).item()
        # each rank holds a shard of the gradient: sum the squares over the groups
        return math.sqrt(self.summed_over_ranks(square_sum_of_norms(norms, weights)))

    def _prepare_streamed(self, loss_scale: float, early_square: torch.Tensor | None, norms=None) -> GradStats:
        """Gradients the optimizer reads as it steps (in the chunk manager, or the 16-bit sources of fp32 masters):
        `norms(unscale)` (default: read one managed shard at a time) for the norm; the optimizer unscales and clips
        each as it steps it, by the same factors in the same order as in memory."""
        unscale = 1.0 / loss_scale
        if not self.needs_norm:
            return GradStats(None, streamed_scale=(unscale,))
        if early_square is not None:
            return GradStats(math.sqrt(self.summed_over_ranks(early_square)), streamed_scale=(unscale,))
        stats, coef = self._clipped(self._total(*(norms or self.chunked.streamed_grad_norms)(unscale)))
        return GradStats(stats.norm, stats.overflow, (unscale, coef))

    def summed_over_ranks(self, square: torch.Tensor) -> float:
        """A rank's (weighted) sum of squared gradient pieces, summed over the data-parallel shards and the
        tensor-parallel ranks (Note [global norm under tensor parallelism]) and the pipeline stages (Note [a
        pipelined step])."""
        square = square.to(self.mesh.device)
        if self.chunked.sharded or self.chunked.has_experts:  # experts: other ranks hold other experts
            # every copy of hybrid sharding's shards adds its share: one sum, the same on every copy (Note [hybrid
            # sharding]); without copies the share is the whole
            all_reduce_sum(square.div_(self.mesh.replicate.size), self.mesh.zero.group, self.comm,
                           async_op=False)
        if self.mesh.tp.size > 1:
            all_reduce_sum(square, self.mesh.tp.group, self.comm, async_op=False)
        if self.mesh.pp.size > 1:
            all_reduce_sum(square, self.mesh.pp.group, self.comm, async_op=False)
        return square.item()

    def _clipped(self, total: float) -> tuple[GradStats, float]:
        """(the stats for a global norm `total`, the clipping factor: 1.0 for none)."""
        overflow = not math.isfinite(total) and self.checks_overflow
        coef = self.clip / (total + 1e-6) if self.clip > 0 and not overflow else 1.0
        return GradStats(total, overflow), coef if coef < 1.0 else 1.0  # a NaN factor is no clipping
