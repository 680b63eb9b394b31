"""The communication of 2D tensor parallelism (SUMMA on a q×q mesh), as autograd functions.

Note [2D tensor parallelism]
The tp group is a q×q mesh (engine/topology.py); rank (r, c) holds, of every activation [batch,
seq, hidden], the block [batch block r, all of seq, hidden block c]: 1/q² of it. A weight W [in,
out] of a linear layer is held as the block [in block r, out block c], also 1/q². SUMMA (van de
Geijn and Watts, 1997; as in Optimus / ColossalAI's 2D) computes Y[r, c] = Σ_k X[r, k] W[k, c] in q
steps: at step k, rank (r, k) broadcasts its X block along row r and rank (k, c) its W block down
column c, and every rank adds the product. The backward mirrors it: dX[r, k] = Σ_c dY[r, c] W[k, c]ᵀ
is reduced along row r to rank (r, k), and dW[k, c] = Σ_r X[r, k]ᵀ dY[r, c] down column c to rank
(k, c), with the same broadcasts of W and X.
Vectors along the hidden dimension (biases, norm weights, embedding tables' columns) are held as
1/q² pieces too: hidden block c is cut into q pieces down column c, piece r at rank (r, c). A use
all-gathers the block down the column; the backward reduce-scatters its gradient there, which also
sums the q batch blocks' contributions.
Gradient convention (Megatron's): a tensor that every rank of a group holds whole and uses the same
way (the logits of a batch block, the loss) carries its whole gradient on every rank, so reducing
into it forward passes the gradient through unchanged backward.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.comm import all_reduce_sum, broadcast_from, reduce_scatter_sum_in_place, reduce_sum_to
from engine.tensor_parallel.mappings import TPGroup, gather_along
from engine.tensor_parallel.shards import BlockSpec2D, PieceSpec2D
from engine.topology import mesh_position


@dataclass(frozen=True)
class Mesh2D:
    """This rank's place in the q×q mesh: its row group (ranks (r, ·), ordered by column) and its column
    group (ranks (·, c), ordered by row); `whole` is the tp group. One byte counter for all of them. Under 2.5D
    (Note [tensor-parallel grids]) `depth` joins the ranks at this (r, c) in the other grids: every grid holds
    the same pieces, takes its own part of the batch, and sums its weight gradients with the others'."""

    q: int
    row: TPGroup  # row.rank == c
    col: TPGroup  # col.rank == r
    whole: TPGroup
    depth: TPGroup | None = None  # 2.5D only: depth.rank is this rank's grid

    @classmethod
    def of(cls, whole: TPGroup, row_group: dist.ProcessGroup | None, col_group: dist.ProcessGroup | None,
           depth_group: dist.ProcessGroup | None = None, depth: int = 1) -> "Mesh2D":
        """The mesh of the tp group `whole` of depth·q² ranks, row-major in each grid (engine/mesh.py): rank t in
        grid t // q² at (t % q² // q, t % q); `depth` > 1 (2.5D) with its group."""
        grid, place = divmod(whole.rank, whole.size // depth)
        q, r, c = mesh_position(place, whole.size // depth)
        deep = TPGroup(depth_group, depth, grid, whole.counter) if depth > 1 else None
        return cls(q, TPGroup(row_group, q, c, whole.counter), TPGroup(col_group, q, r, whole.counter), whole, deep)

    @property
    def r(self) -> int:
        return self.col.rank

    @property
    def c(self) -> int:
        return self.row.rank

    @property
    def mode(self) -> str:
        return "2.5d" if self.depth is not None else "2d"

    @property
    def width(self) -> int:
        """The parts the hidden dimension of an activation is split into."""
        return self.q

    @property
    def batch_groups(self) -> tuple[TPGroup, ...]:
        """The groups the batch is split over, inner first: the column, then (2.5D) the grids."""
        return (self.col,) if self.depth is None else (self.col, self.depth)

    @property
    def replicas(self) -> TPGroup | None:
        """The ranks holding the same pieces (2.5D: the grids); their gradients are summed over it."""
        return self.depth

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, transposed: bool, parts: int = 1) -> torch.Tensor:
        """Y = x W by SUMMA (a fused projection's blocks are laid out by its weight's cut: `parts` is not needed)."""
        return summa_matmul(x, weight, self, transposed)

    def weight_spec(self, in_dim: int, out_dim: int, parts: int = 1) -> BlockSpec2D:
        return BlockSpec2D(in_dim, out_dim, parts, depth=self.depth.size if self.depth else 1)

    def vector_spec(self, dim: int, parts: int = 1) -> PieceSpec2D:
        return PieceSpec2D(dim, parts, depth=self.depth.size if self.depth else 1)

    def describe(self) -> str:
        return f"{self.q}x{self.q}" + (f" x{self.depth.size} deep" if self.depth else "")


def _block_from(mine: torch.Tensor, k: int, group: TPGroup) -> torch.Tensor:
    """Group rank k's block (all blocks have `mine`'s shape), broadcast over `group`."""
    block = mine.contiguous() if group.rank == k else torch.empty_like(mine, memory_format=torch.contiguous_format)
    broadcast_from(block, k, group.group, group.counter)
    return block


def _matmul(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x W with W stored as nn.Linear's [out, in] or, `transposed`, Conv1D's [in, out]."""
    return x @ weight if transposed else F.linear(x, weight)


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, mesh, transposed):
        ctx.mesh, ctx.transposed = mesh, transposed
        ctx.save_for_backward(x, weight)
        y = None
        with autocast_off(x):  # summa_matmul cast both already
            for k in range(mesh.q):
                part = _matmul(_block_from(x, k, mesh.row), _block_from(weight, k, mesh.col), transposed)
                y = part if y is None else y.add_(part)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        mesh, transposed = ctx.mesh, ctx.transposed
        grad_y = grad_y.contiguous()
        rows_y = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = None
        for k in range(mesh.q):
            w_k = _block_from(weight, k, mesh.col).to(grad_y.dtype)  # W[k, c]
            part_x = grad_y @ (w_k.t() if transposed else w_k)  # dY[r, c] W[k, c]ᵀ, summed along the row
            reduce_sum_to(part_x, k, mesh.row.group, mesh.row.counter)
            if mesh.c == k:
                grad_x = part_x
            if not ctx.needs_input_grad[1]:  # a frozen weight: no gradient, and no collective for it
                continue
            x_k = _block_from(x, k, mesh.row).to(grad_y.dtype)  # X[r, k]
            rows_x = x_k.reshape(-1, x_k.shape[-1])
            part_w = rows_x.t() @ rows_y if transposed else rows_y.t() @ rows_x  # X[r, k]ᵀ dY[r, c], down the column
            reduce_sum_to(part_w, k, mesh.col.group, mesh.col.counter)
            if mesh.r == k:
                grad_w = part_w
        if grad_w is not None:
            sum_over_replicas(grad_w, mesh)
        return grad_x, grad_w, None, None


def sum_over_replicas(grad: torch.Tensor, mesh) -> None:
    """Sums a parameter piece's gradient, in place, over the ranks holding the same piece (2.5D's grids, each of
    which saw its own part of the batch); nothing elsewhere."""
    if mesh.replicas is not None:
        all_reduce_sum(grad, mesh.replicas.group, mesh.replicas.counter, async_op=False)


def summa_matmul(x: torch.Tensor, weight: torch.Tensor, mesh: Mesh2D, transposed: bool = False) -> torch.Tensor:
    """Forward: Y[r, c] = Σ_k X[r, k] W[k, c] (broadcasts along the row and down the column). Backward: dX and dW
    by the same broadcasts and reductions (Note [2D tensor parallelism]). Under autocast both are cast to its dtype
    first, as F.linear would be (and the blocks broadcast are then the narrow ones)."""
    x, weight = autocast_both(x, weight)
    return _Summa.apply(x, weight, mesh, transposed)


def autocast_off(x: torch.Tensor):
    """Autocast switched off for x's device (a meta tensor's: nothing to switch)."""
    return torch.autocast(x.device.type, enabled=False) if x.device.type in ("cpu", "cuda") else \
        contextlib.nullcontext()


def autocast_both(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both in autocast's dtype where it is on for x's device (a meta tensor, traced by the estimate, has none)."""
    device_type = x.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return x.to(dtype), weight.to(dtype)
    return x, weight


class _GatherDownColumn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece, mesh, dim):
        ctx.mesh, ctx.dim = mesh, dim
        return gather_along(piece, mesh.col, dim)

    @staticmethod
    def backward(ctx, grad):
        col = ctx.mesh.col
        stacked = torch.stack(grad.chunk(col.size, dim=ctx.dim)).contiguous()  # [q, *piece]: piece r's gradient at r
        reduce_scatter_sum_in_place(stacked.view(-1), col.group, col.rank, col.size, col.counter, async_op=False)
        mine = stacked[col.rank]
        sum_over_replicas(mine, ctx.mesh)
        return mine, None, None


def gather_down_column(piece: torch.Tensor, mesh, dim: int) -> torch.Tensor:
    """Forward: all-gather the column's pieces of a parameter along `dim` (hidden block c). Backward: reduce-scatter
    its gradient down the column (each piece's gradient, summed over the q batch blocks), and sum it over the
    replicas (2.5D). `mesh`: a Mesh2D or a Mesh3D (whose column is its i axis)."""
    return _GatherDownColumn.apply(piece, mesh, dim)


class _GatherBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        for group in mesh.batch_groups:
            x = gather_along(x, group, 0)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(batch_parts(ctx.mesh), dim=0)[batch_index(ctx.mesh)], None


def gather_batch(x: torch.Tensor, mesh) -> torch.Tensor:
    """Forward: all-gather the batch blocks (a tensor the row holds whole, e.g. logits). Backward: keep this rank's
    batch block of the gradient."""
    return _GatherBatch.apply(x, mesh)


def batch_parts(mesh) -> int:
    """The blocks the batch is cut into: q in 2D and 3D, depth × q in 2.5D."""
    return math.prod(group.size for group in mesh.batch_groups)


def batch_index(mesh) -> int:
    """This rank's batch block: the outer groups' ranks are the more significant digits."""
    index = 0
    for group in reversed(mesh.batch_groups):
        index = index * group.size + group.rank
    return index


def batch_block(x: torch.Tensor, mesh, what: str) -> torch.Tensor:
    """This rank's batch block of x (split along dim 0)."""
    parts = batch_parts(mesh)
    if x.dim() == 0 or x.shape[0] % parts:
        raise ValueError(f"{what}: a batch of {x.shape[0] if x.dim() else 0} does not split into the {parts} batch "
                         f"blocks of {mesh.mode.upper()} tensor parallelism; use a micro-batch divisible by {parts}")
    return x.chunk(parts, dim=0)[batch_index(mesh)]
