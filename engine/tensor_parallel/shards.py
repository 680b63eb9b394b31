"""How a parameter is cut over the tensor-parallel ranks, and put back together.

A spec's take(full, tp, what) is this rank's piece of the whole tensor (a copy); join(pieces) the
whole tensor from every rank's piece in tp rank order, for engine.full_state_dict. ShardSpec is the
1D cut (one dimension over tp ranks); BlockSpec2D and PieceSpec2D are the 2D cuts of a q×q mesh
(Note [2D tensor parallelism]), `depth` grids holding the same pieces under 2.5D; BlockSpec3D and
PieceSpec3D the cuts of a q×q×q cube (Note [tensor-parallel grids]). A fused projection (q/k/v) has
`parts` blocks along its output dimension, each cut the same way, so every rank holds matching heads
of q, k and v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.grid_shapes import grid_side
from engine.tensor_parallel.mappings import TPGroup
from engine.topology import mesh_position


@dataclass(frozen=True)
class ShardSpec:
    """A parameter split over the tp ranks along `dim`; with parts > 1 the dimension is `parts` blocks
    (a fused q/k/v projection) and each block is split, rank r holding slice r of every block."""

    dim: int
    parts: int = 1

    def take(self, full: torch.Tensor, tp: TPGroup, what: str) -> torch.Tensor:
        size = full.shape[self.dim]
        if size % (self.parts * tp.size):
            raise ValueError(f"{what}: dimension {self.dim} of size {size} does not split into {self.parts} block(s) "
                             f"× {tp.size} tensor-parallel ranks; choose a tensor_parallel.size that divides it")
        blocks = full.chunk(self.parts, dim=self.dim)
        return torch.cat([b.chunk(tp.size, dim=self.dim)[tp.rank] for b in blocks], dim=self.dim).contiguous()

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        per_rank = [s.chunk(self.parts, dim=self.dim) for s in shards]
        return torch.cat([torch.cat([blocks[b] for blocks in per_rank], dim=self.dim) for b in range(self.parts)],
                         dim=self.dim)


def shard_param(p: nn.Parameter | None, spec: Spec, tp: TPGroup, what: str) -> nn.Parameter | None:
    if p is None:
        return None
    return nn.Parameter(spec.take(p.detach(), tp, what), requires_grad=p.requires_grad)


def _fused_block(full: torch.Tensor, dim: int, parts: int, q: int, c: int) -> torch.Tensor:
    """Block c of `full` along dim, taken from each of its `parts` blocks alike."""
    return torch.cat([b.chunk(q, dim=dim)[c] for b in full.chunk(parts, dim=dim)], dim=dim)


def _unfuse(blocks: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The inverse of _fused_block over c = 0..q-1."""
    per_block = [b.chunk(parts, dim=dim) for b in blocks]
    return torch.cat([torch.cat([p[i] for p in per_block], dim=dim) for i in range(parts)], dim=dim)


def _check_divides(full: torch.Tensor, dim: int, by: int, what: str, grid: str) -> None:
    if full.shape[dim] % by:
        raise ValueError(f"{what}: dimension {dim} of size {full.shape[dim]} does not split into {by} pieces for the "
                         f"{grid} of tensor parallelism; choose a grid side q whose pieces divide it")


def _grid_place(tp: TPGroup, depth: int) -> tuple[int, int, int]:
    """(q, r, c) of a tp rank in its q×q grid, the tp group being `depth` such grids (2.5D; 2D: depth 1)."""
    return mesh_position(tp.rank % (tp.size // depth), tp.size // depth)


@dataclass(frozen=True)
class BlockSpec2D:
    """A linear layer's weight: rank (r, c) holds [input block r, output block c]; `in_dim` and `out_dim` are
    the stored dimensions (nn.Linear [out, in]: 1 and 0; Conv1D [in, out]: 0 and 1)."""

    in_dim: int
    out_dim: int
    parts: int = 1
    depth: int = 1  # 2.5D: grids holding the same pieces

    def take(self, full: torch.Tensor, tp: TPGroup, what: str) -> torch.Tensor:
        q, r, c = _grid_place(tp, self.depth)
        _check_divides(full, self.in_dim, q, what, f"{q}×{q} mesh")
        _check_divides(full, self.out_dim, q * self.parts, what, f"{q}×{q} mesh")
        rows = full.chunk(q, dim=self.in_dim)[r]
        return _fused_block(rows, self.out_dim, self.parts, q, c).contiguous()

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        q = math.isqrt(len(shards) // self.depth)  # the first grid's pieces: the others hold the same
        rows = [_unfuse(shards[r * q:(r + 1) * q], self.out_dim, self.parts) for r in range(q)]
        return torch.cat(rows, dim=self.in_dim)


@dataclass(frozen=True)
class PieceSpec2D:
    """A vector along the hidden dimension (bias, norm weight, an embedding table's columns): hidden block c
    (of each of `parts` fused blocks) is cut into q pieces down column c, piece r at rank (r, c)."""

    dim: int
    parts: int = 1
    depth: int = 1  # 2.5D: grids holding the same pieces

    def take(self, full: torch.Tensor, tp: TPGroup, what: str) -> torch.Tensor:
        q, r, c = _grid_place(tp, self.depth)
        _check_divides(full, self.dim, q * q * self.parts, what, f"{q}×{q} mesh")
        return _fused_block(full, self.dim, self.parts, q, c).chunk(q, dim=self.dim)[r].contiguous()

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        q = math.isqrt(len(shards) // self.depth)
        blocks = [torch.cat([shards[r * q + c] for r in range(q)], dim=self.dim) for c in range(q)]
        return _unfuse(blocks, self.dim, self.parts)


def _cube_place(tp: TPGroup) -> tuple[int, int, int, int]:
    """(q, i, j, k) of a tp rank in the q×q×q cube, row-major: rank = i·q² + j·q + k."""
    q = grid_side(tp.size, "3d")
    i, plane = divmod(tp.rank, q * q)
    return q, i, *divmod(plane, q)


@dataclass(frozen=True)
class BlockSpec3D:
    """A linear layer's weight in the cube: rank (i, j, k) holds piece i (along the input) of the block [input block
    j, output block k], which its i axis gathers (Note [tensor-parallel grids])."""

    in_dim: int
    out_dim: int
    parts: int = 1

    def take(self, full: torch.Tensor, tp: TPGroup, what: str) -> torch.Tensor:
        q, i, j, k = _cube_place(tp)
        _check_divides(full, self.in_dim, q * q, what, f"{q}×{q}×{q} cube")
        _check_divides(full, self.out_dim, q * q * self.parts, what, f"{q}×{q}×{q} cube")  # its output, too, splits q²
        block = _fused_block(full.chunk(q, dim=self.in_dim)[j], self.out_dim, self.parts, q, k)
        return block.chunk(q, dim=self.in_dim)[i].contiguous()

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        q = grid_side(len(shards), "3d")

        def block(j: int, k: int) -> torch.Tensor:
            return torch.cat([shards[i * q * q + j * q + k] for i in range(q)], dim=self.in_dim)
        return torch.cat([_unfuse([block(j, k) for k in range(q)], self.out_dim, self.parts) for j in range(q)],
                         dim=self.in_dim)


@dataclass(frozen=True)
class PieceSpec3D:
    """A vector along the hidden dimension in the cube: the hidden dimension (each of `parts` fused blocks) is cut
    into q² pieces, piece j·q + k (the plane's) into q, the i-th at rank (i, j, k)."""

    dim: int
    parts: int = 1

    def take(self, full: torch.Tensor, tp: TPGroup, what: str) -> torch.Tensor:
        q, i, j, k = _cube_place(tp)
        _check_divides(full, self.dim, q ** 3 * self.parts, what, f"{q}×{q}×{q} cube")
        return _fused_block(full, self.dim, self.parts, q * q, j * q + k).chunk(q, dim=self.dim)[i].contiguous()

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        q = grid_side(len(shards), "3d")
        pieces = [torch.cat([shards[i * q * q + p] for i in range(q)], dim=self.dim) for p in range(q * q)]
        return _unfuse(pieces, self.dim, self.parts)


Spec = ShardSpec | BlockSpec2D | PieceSpec2D | BlockSpec3D | PieceSpec3D


def shared_or_sharded(p: nn.Parameter, spec: Spec, tp: TPGroup, what: str, shared: dict | None) -> nn.Parameter:
    """A tied weight (one Parameter in two modules, e.g. embedding and lm_head) is sharded once and the
    shard shared again; both uses must split it the same way."""
    if shared is not None and id(p) in shared:
        shard, first_spec, first = shared[id(p)]
        if first_spec != spec:
            raise ValueError(f"{what} is tied to {first}, which the plan splits differently ({first_spec} vs {spec}); "
                             "give both the same style in tensor_parallel.plan")
        return shard
    shard = shard_param(p, spec, tp, what)
    if shared is not None:
        shared[id(p)] = (shard, spec, what)
    return shard
