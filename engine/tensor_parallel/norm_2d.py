"""Layer norm and RMS norm over a hidden dimension split along the rows of the 2D mesh, as one autograd
function (Note [2D tensor parallelism]): the per-token sums over the hidden dimension are all-reduced
along the row, forward and backward, and only the output and the per-token scale are saved.
"""

from __future__ import annotations

import torch

from engine.comm import all_reduce_sum
from engine.tensor_parallel.mappings_2d import Mesh2D


class _NormalizeAlongRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, hidden, eps, rms):
        ctx.mesh, ctx.hidden, ctx.rms = mesh, hidden, rms
        h = x.float()
        if not rms:  # two passes, as torch's layer norm: the mean first, then the centred squares
            mean = h.sum(-1, keepdim=True)
            all_reduce_sum(mean, mesh.row.group, mesh.row.counter, async_op=False)
            h = h - mean / hidden
        square = h.pow(2).sum(-1, keepdim=True)
        all_reduce_sum(square, mesh.row.group, mesh.row.counter, async_op=False)
        rstd = torch.rsqrt(square / hidden + eps)
        out = (h * rstd).to(x.dtype)
        ctx.save_for_backward(out, rstd)  # the output is what the affine step saves anyway: one block kept
        return out

    @staticmethod
    def backward(ctx, grad):
        out, rstd = ctx.saved_tensors
        g, normed = grad.float(), out.float()
        sums = [(g * normed).sum(-1, keepdim=True)]
        if not ctx.rms:
            sums.append(g.sum(-1, keepdim=True))
        both = torch.cat(sums, dim=-1)  # one all-reduce for the row's sums over the whole hidden dimension
        all_reduce_sum(both, ctx.mesh.row.group, ctx.mesh.row.counter, async_op=False)
        both = both / ctx.hidden
        grad_x = g - normed * both[..., :1]
        if not ctx.rms:
            grad_x = grad_x - both[..., 1:]
        return (grad_x * rstd).to(grad.dtype), None, None, None, None


def normalize_along_row(x: torch.Tensor, mesh: Mesh2D, hidden: int, eps: float, rms: bool) -> torch.Tensor:
    """Layer norm (or, `rms`, RMS norm) without its affine step, over a hidden dimension of `hidden` split along
    the row: the per-token sums are all-reduced along the row, forward and backward. Computed in fp32, returned in
    x's dtype; saves only its output and the per-token scale."""
    return _NormalizeAlongRow.apply(x, mesh, hidden, eps, rms)
