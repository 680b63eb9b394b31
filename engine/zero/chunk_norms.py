"""The norms of the gradient elements this rank owns, cut at parameter boundaries (Note [global norm under tensor
parallelism]), in memory or streamed from managed shards (Note [offloaded gradient shards]).

Note [the norm where the gradient is reduced]
With managed gradient shards, a boundary backward whose update needs the global norm measures each shard's
pieces from its reduced values on the compute device, just before they go down to the shard's home, when they
are the whole of the shard (its first contribution since the last update), as DeepSpeed takes the norm before
the copy to the host: the step then adds scalars instead of reading every 16-bit gradient back on the host. A
later contribution to the shard (a second backward at the boundary) drops its measure, every zeroing drops them
all, and a shard without one is read back at the step. The values measured are the bytes that go down, so the
norms are the ones the step would take (on the CPU seam bit for bit; a GPU's reduction order is its own).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.comm import shard_of
from engine.zero.chunk_state import ChunkState
from engine.zero.master_weights import MasterWeights

NORM_TILE = 1 << 20  # elements widened at a time (fp32 scratch, reused; larger tiles cost less per element here)


class ChunkNorms:
    """ChunkedParams' gradient norms (a part of it: the attributes below are ChunkedParams')."""

    states: list[ChunkState]
    params: list[nn.Parameter]
    norm_weights: dict[int, float]
    masters: MasterWeights | None
    _retired_norms: dict[int, tuple[torch.Tensor, torch.Tensor]]  # Note [the norm where the gradient is reduced]

    def _norm_pieces(self, index: int, owned: torch.Tensor) -> list[tuple[torch.Tensor, float]]:
        """`owned` (this rank's elements of chunk `index`) cut at parameter boundaries, each piece with its
        parameter's norm weight."""
        pieces = []
        state = self.states[index]
        for slot, p in zip(state.slots, state.params):
            part = self._owned_range(index, slot)
            if part is not None:
                start, lo, hi = part
                pieces.append((owned.narrow(0, lo - start, hi - lo), self.norm_weights.get(id(p), 1.0)))
        return pieces

    def grad_norm_pieces(self) -> list[tuple[torch.Tensor, float]]:
        """The gradient elements this rank owns cut at parameter boundaries (norms taken per piece, as torch's
        clip_grad_norm_ takes them per parameter, keep fp32 accuracy; one fp32 reduction over a whole chunk loses
        ~1e-5), each with its parameter's share of the squared global norm (Note [global norm under tensor
        parallelism]); summing over the shard group gives the global norm."""
        if not self.sharded and not self.has_masters and not self.shards_grads:  # .grad is the whole gradient
            return [(p.grad, self.norm_weights.get(id(p), 1.0)) for p in self.params]
        # cut from the stepped gradients: this rank's shards, or the fp32 masters' gradients
        return [wp for index, owned in enumerate(self.grad_shards()) for wp in self._norm_pieces(index, owned)]

    def streamed_grad_norms(self, unscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Note [offloaded gradient shards]: the norms of this rank's gradient pieces (as grad_norm_pieces cuts
        them) and their weights, reading one managed shard at a time (see grad_norms)."""
        norms, weights = zip(*(self.grad_norms(index, unscale) for index in range(len(self.states))))
        return torch.cat(norms), torch.cat(weights)

    def grad_norms(self, index: int, unscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 norms, float64 weights) of the pieces of managed gradient shard `index`, times `unscale` (the norms
        of the unscaled values, up to rounding): measured as the shard went down (Note [the norm where the gradient
        is reduced]), else read back."""
        measured = self._retired_norms.pop(index, None)
        if measured is None:
            with self.sharded_grads.shard(index, writes=False) as shard:
                measured = self._norms_of(self._norm_pieces(index, shard), shard)
        norms, weights = measured
        return (norms * unscale if unscale != 1.0 else norms).cpu(), weights

    def measure_before_retire(self, index: int) -> None:
        """Note [the norm where the gradient is reduced]: the norms of managed gradient shard `index`'s pieces, from
        its reduced values on the compute device before they go down to the shard's home; grad_norms takes them
        instead of reading the shard back."""
        state = self.states[index]
        reduced = shard_of(state.grad_chunk.payload, state.place.rank, state.place.count)
        self._retired_norms[index] = self._norms_of(self._norm_pieces(index, reduced), reduced)

    def forget_retired_norm(self, index: int | None = None) -> None:
        """Shard `index` (None: every shard) changed since its norms were measured."""
        if index is None:
            self._retired_norms.clear()
        else:
            self._retired_norms.pop(index, None)

    def in_memory_grad_norms(self, unscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The norms of grad_norm_pieces (gradients held in memory, left scaled: Note [one gradient factor]) times
        `unscale`, and their weights."""
        norms, weights = piece_norms(self.grad_norm_pieces())
        return (norms * unscale if unscale != 1.0 else norms), weights

    def master_grad_norms(self, unscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The norms of the 16-bit gradients the fp32 masters are stepped from (Note [master weights]), taken as
        grad_norms takes managed 16-bit shards: the in-memory and the offloaded step clip by the same norm."""
        sources = self.masters.grad_sources
        pieces = [wp for index, source in enumerate(sources) for wp in self._norm_pieces(index, source)]
        norms, weights = self._norms_of(pieces, sources[0])
        return (norms * unscale if unscale != 1.0 else norms), weights

    def _norms_of(self, pieces: list[tuple[torch.Tensor, float]], whole: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
        """piece_norms of pieces cut from `whole`; 16-bit ones widened a tile at a time into scratch made once."""
        if whole.dtype == torch.float32:
            return piece_norms(pieces)
        tile = getattr(self, "_norm_tile", None)
        if tile is None or tile.device != whole.device:
            tile = self._norm_tile = torch.empty(NORM_TILE, dtype=torch.float32, device=whole.device)
        return widened_piece_norms(pieces, tile)


def piece_norms(pieces: list[tuple[torch.Tensor, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp32 norm of each piece, its weight in float64): per-piece norms keep fp32 accuracy, as torch's
    clip_grad_norm_ takes them per parameter; bf16 pieces (the gradients of bf16 masters, Note [bf16 master
    weights]) are summed in fp32 too."""
    weights = torch.tensor([w for _, w in pieces], dtype=torch.float64)
    if not pieces:
        return torch.zeros(0), weights
    return torch.stack(torch._foreach_norm([piece for piece, _ in pieces], 2.0, dtype=torch.float32)), weights


def widened_piece_norms(pieces: list[tuple[torch.Tensor, float]], tile: torch.Tensor) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """piece_norms of 16-bit pieces, widened a tile at a time into `tile` (fp32 scratch, reused: no fp32 copy of a
    whole shard, which torch's norms make when asked for an fp32 result) and their squares summed in float64."""
    if tile.device.type != "cpu":  # an accelerator's norm kernels widen as they read
        return piece_norms(pieces)
    weights = torch.tensor([w for _, w in pieces], dtype=torch.float64)
    norms = torch.empty(len(pieces), dtype=torch.float32)
    for i, (piece, _) in enumerate(pieces):
        flat, square = piece.reshape(-1), torch.zeros((), dtype=torch.float64, device=piece.device)
        for start in range(0, flat.numel(), tile.numel()):
            wide = tile[:min(tile.numel(), flat.numel() - start)]
            wide.copy_(flat[start:start + wide.numel()])
            square += torch.dot(wide, wide)
        norms[i] = square.sqrt()
    return norms, weights


def square_sum_of_norms(norms: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum of weight * norm^2 in float64."""
    return (norms.double().square() * weights.to(norms.device)).sum()
