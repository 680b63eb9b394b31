"""The communication of 3D tensor parallelism (a q×q×q cube), as autograd functions.

Note [tensor-parallel grids]
2D (SUMMA, Note [2D tensor parallelism]) has two relatives that ColossalAI made known:
- 2.5D (Tesseract; mode "2.5d", size depth·q²): `depth` q×q grids side by side. Each grid runs 2D on its own
  part of the batch: the batch is cut into depth·q blocks, grid g's row r taking block g·q + r. Every grid
  holds the same pieces of every parameter, so a piece's gradient is summed over the grids (the depth group)
  where 2D's backward leaves it: the legacy ColossalAI code cut the batch over the column only and left out
  that sum. The loss, the batch gather and the norm of the gradients count every grid's part once.
- 3D (mode "3d", size q³): rank (i, j, k), row-major. An activation [batch, seq, hidden] is held as batch block
  i and hidden piece j·q + k of q² (1/q³ of it); every parameter is a 1/q³ piece. Y = X W runs in five steps:
  gather X's pieces along k into input block j; gather W's block [input block j, output block k] along i
  (piece i is stored at (i, j, k)); multiply, a partial sum over j of Y's output block k; reduce-scatter it
  along j, leaving piece k·q + j at (i, j, k); exchange that with the rank (i, k, j), so that every rank holds
  piece j·q + k again. The exchange (1/q³ of the activation each way) keeps one layout between all layers, so
  an unmodified model's plan is a 2D plan, where ColossalAI alternates two layouts from layer to layer. The
  backward mirrors it: exchange, gather the output gradient along j, reduce-scatter the input gradient along k
  and the weight gradient along i. Hidden vectors (biases, norm weights, embedding columns) are gathered along
  i, as 2D gathers them down the column; norms sum over the plane (the ranks of batch block i), and the
  classifier sums its partial logits there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.comm import exchange_with, reduce_scatter_sum_in_place
from engine.grid_shapes import grid_side
from engine.tensor_parallel.mappings import TPGroup, gather_along
from engine.tensor_parallel.mappings_2d import autocast_both, autocast_off
from engine.tensor_parallel.shards import BlockSpec3D, PieceSpec3D


@dataclass(frozen=True)
class Mesh3D:
    """This rank's place (i, j, k) in the cube: `col` the ranks that differ in i (the batch blocks; the hidden
    vectors' pieces), `row` the plane of batch block i (rank j·q + k: the hidden pieces), `j` and `k` the ranks
    that differ in that coordinate; `whole` is the tp group. One byte counter for all."""

    q: int
    row: TPGroup
    col: TPGroup
    j: TPGroup
    k: TPGroup
    whole: TPGroup

    @classmethod
    def of(cls, whole: TPGroup, groups: dict[str, dist.ProcessGroup | None]) -> "Mesh3D":
        """The cube of the q³-rank tp group `whole` from its "plane", "i", "j" and "k" groups (engine/mesh.py). Runs
        one collective over the plane (every rank of the tp group calls it), which the exchange needs first."""
        q = grid_side(whole.size, "3d")
        i, plane = divmod(whole.rank, q * q)
        j, k = divmod(plane, q)

        def group(name: str, size: int, rank: int) -> TPGroup:
            return TPGroup(groups[name], size, rank, whole.counter)
        mesh = cls(q, group("plane", q * q, plane), group("i", q, i), group("j", q, j), group("k", q, k), whole)
        if groups["plane"] is not None:
            dist.barrier(group=groups["plane"])  # the plane's communicator, before a pair exchanges over it
        return mesh

    mode = "3d"
    depth = None

    @property
    def width(self) -> int:
        return self.q * self.q

    @property
    def batch_groups(self) -> tuple[TPGroup, ...]:
        return (self.col,)

    @property
    def replicas(self) -> None:
        return None  # every piece is held once

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, transposed: bool, parts: int = 1) -> torch.Tensor:
        """Y = x W over the cube; a fused projection's `parts` blocks are each cut alike."""
        x, weight = autocast_both(x, weight)  # as F.linear under autocast; the pieces sent are the narrow ones
        return _CubeMatmul.apply(x, weight, self, transposed, parts)

    def weight_spec(self, in_dim: int, out_dim: int, parts: int = 1) -> BlockSpec3D:
        return BlockSpec3D(in_dim, out_dim, parts)

    def vector_spec(self, dim: int, parts: int = 1) -> PieceSpec3D:
        return PieceSpec3D(dim, parts)

    def describe(self) -> str:
        return f"{self.q}x{self.q}x{self.q}"

    @property
    def partner(self) -> int:
        """The plane rank of (i, k, j)."""
        return self.k.rank * self.q + self.j.rank


def _reduce_scatter_last(partial: torch.Tensor, group: TPGroup, parts: int) -> torch.Tensor:
    """Sums `partial` over `group` and keeps this rank's piece of its last dimension (of each of `parts` fused
    blocks alike)."""
    *lead, width = partial.shape
    blocks = partial.reshape(*lead, parts, group.size, width // (parts * group.size))
    stacked = blocks.movedim(-2, 0).contiguous()  # [q, *lead, parts, w]
    reduce_scatter_sum_in_place(stacked.view(-1), group.group, group.rank, group.size, group.counter, async_op=False)
    return stacked[group.rank].reshape(*lead, width // group.size)


def _gather_last(piece: torch.Tensor, group: TPGroup, parts: int) -> torch.Tensor:
    """The inverse of _reduce_scatter_last's cut: every rank's piece, back in place along the last dimension."""
    *lead, width = piece.shape
    gathered = gather_along(piece.unsqueeze(0), group, 0)  # [q, *lead, width]
    blocks = gathered.reshape(group.size, *lead, parts, width // parts).movedim(0, -2)
    return blocks.reshape(*lead, width * group.size)


def _reduce_scatter_along(partial: torch.Tensor, group: TPGroup, dim: int) -> torch.Tensor:
    """Sums `partial` over `group` and keeps this rank's piece along `dim`."""
    stacked = torch.stack(partial.chunk(group.size, dim=dim)).contiguous()
    reduce_scatter_sum_in_place(stacked.view(-1), group.group, group.rank, group.size, group.counter, async_op=False)
    return stacked[group.rank]


def _linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x @ weight if transposed else F.linear(x, weight)


class _CubeMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, mesh, transposed, parts):
        ctx.mesh, ctx.transposed, ctx.parts = mesh, transposed, parts
        ctx.save_for_backward(x, weight)
        with autocast_off(x):  # matmul cast both already
            block_x = gather_along(x, mesh.k, x.dim() - 1)  # [.., input block j]
            block_w = gather_along(weight, mesh.col, 0 if transposed else 1)  # W[j, k]
            partial = _linear(block_x, block_w, transposed)  # Y's output block k, summed over j below
            mine = _reduce_scatter_last(partial, mesh.j, parts)
        return exchange_with(mine, mesh.partner, mesh.row.group, mesh.row.counter)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        mesh, transposed = ctx.mesh, ctx.transposed
        grad_y = exchange_with(grad_y.contiguous(), mesh.partner, mesh.row.group, mesh.row.counter)
        block_grad = _gather_last(grad_y, mesh.j, ctx.parts)  # dY's output block k
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            block_w = gather_along(weight, mesh.col, 0 if transposed else 1).to(grad_y.dtype)
            partial_x = block_grad @ (block_w.t() if transposed else block_w)  # summed over k
            grad_x = _reduce_scatter_along(partial_x, mesh.k, partial_x.dim() - 1)
        if ctx.needs_input_grad[1]:  # (a frozen weight: no gradient, and no collective for it)
            block_x = gather_along(x, mesh.k, x.dim() - 1).to(grad_y.dtype)
            rows_x, rows_grad = block_x.reshape(-1, block_x.shape[-1]), block_grad.reshape(-1, block_grad.shape[-1])
            partial_w = rows_x.t() @ rows_grad if transposed else rows_grad.t() @ rows_x  # summed over i
            grad_w = _reduce_scatter_along(partial_w, mesh.col, 0 if transposed else 1)
        return grad_x, grad_w, None, None, None
