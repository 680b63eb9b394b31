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

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.comm import broadcast_from, reduce_scatter_sum_in_place, reduce_sum_to
from engine.tensor_parallel.mappings import TPGroup, gather_along
from engine.topology import mesh_position


@dataclass(frozen=True)
class Mesh2D:
    """This rank's place in the q×q mesh: its row group (ranks (r, ·), ordered by column) and its column
    group (ranks (·, c), ordered by row); `whole` is the q²-rank tp group. One byte counter for all three."""

    q: int
    row: TPGroup  # row.rank == c
    col: TPGroup  # col.rank == r
    whole: TPGroup

    @classmethod
    def of(cls, whole: TPGroup, row_group: dist.ProcessGroup | None, col_group: dist.ProcessGroup | None) -> "Mesh2D":
        """The mesh of the q²-rank tp group `whole`, row-major (engine/topology.py): rank t at (t // q, t % q)."""
        q, r, c = mesh_position(whole.rank, whole.size)
        return cls(q, TPGroup(row_group, q, c, whole.counter), TPGroup(col_group, q, r, whole.counter), whole)

    @property
    def r(self) -> int:
        return self.col.rank

    @property
    def c(self) -> int:
        return self.row.rank


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
        with torch.autocast(x.device.type, enabled=False):  # summa_matmul cast both already
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
            x_k = _block_from(x, k, mesh.row).to(grad_y.dtype)  # X[r, k]
            rows_x = x_k.reshape(-1, x_k.shape[-1])
            part_w = rows_x.t() @ rows_y if transposed else rows_y.t() @ rows_x  # X[r, k]ᵀ dY[r, c], down the column
            reduce_sum_to(part_w, k, mesh.col.group, mesh.col.counter)
            if mesh.r == k:
                grad_w = part_w
        return grad_x, grad_w, None, None


def summa_matmul(x: torch.Tensor, weight: torch.Tensor, mesh: Mesh2D, transposed: bool = False) -> torch.Tensor:
    """Forward: Y[r, c] = Σ_k X[r, k] W[k, c] (broadcasts along the row and down the column). Backward: dX and dW
    by the same broadcasts and reductions (Note [2D tensor parallelism]). Under autocast both are cast to its dtype
    first, as F.linear would be (and the blocks broadcast are then the narrow ones)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
    return _Summa.apply(x, weight, mesh, transposed)


class _GatherDownColumn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece, mesh, dim):
        ctx.mesh, ctx.dim = mesh, dim
        return gather_along(piece, mesh.col, dim)

    @staticmethod
    def backward(ctx, grad):
        mesh = ctx.mesh
        stacked = torch.stack(grad.chunk(mesh.q, dim=ctx.dim)).contiguous()  # [q, *piece]: piece r's gradient at r
        reduce_scatter_sum_in_place(stacked.view(-1), mesh.col.group, mesh.r, mesh.q, mesh.col.counter,
                                    async_op=False)
        return stacked[mesh.r], None, None


def gather_down_column(piece: torch.Tensor, mesh: Mesh2D, dim: int) -> torch.Tensor:
    """Forward: all-gather the column's pieces of a parameter along `dim` (hidden block c). Backward: reduce-scatter
    its gradient down the column (each piece's gradient, summed over the q batch blocks)."""
    return _GatherDownColumn.apply(piece, mesh, dim)


class _GatherBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return gather_along(x, mesh.col, 0)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.mesh.q, dim=0)[ctx.mesh.r], None


def gather_batch(x: torch.Tensor, mesh: Mesh2D) -> torch.Tensor:
    """Forward: all-gather the batch blocks down the column (a tensor the row holds whole, e.g. logits). Backward:
    keep this rank's batch block of the gradient."""
    return _GatherBatch.apply(x, mesh)


def batch_block(x: torch.Tensor, mesh: Mesh2D, what: str) -> torch.Tensor:
    """This rank's batch block r of x (split along dim 0)."""
    if x.dim() == 0 or x.shape[0] % mesh.q:
        raise ValueError(f"{what}: a batch of {x.shape[0] if x.dim() else 0} does not split into the {mesh.q} batch "
                         f"blocks of 2D tensor parallelism (q = {mesh.q}); use a micro-batch divisible by {mesh.q}")
    return x.chunk(mesh.q, dim=0)[mesh.r]
