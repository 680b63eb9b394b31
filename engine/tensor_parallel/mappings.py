"""The four communication steps of tensor parallelism, as autograd functions in mirror-image pairs.

Each one's backward is its mirror's forward (Megatron's layout): copy ↔ reduce, split ↔ gather.
Activations are split and gathered along their last dimension. Every collective runs over the
tensor-parallel group given (a TPGroup: process group, size, rank and the byte counter), never a
global one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.comm import CommCounter, all_gather_into, all_reduce_sum


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel process group and this rank's place in it."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    counter: CommCounter = field(default_factory=CommCounter, compare=False)


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    all_reduce_sum(out, tp.group, tp.counter, async_op=False)
    return out


def _split_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    width = x.shape[-1]
    if width % tp.size:
        raise ValueError(f"cannot split a last dimension of {width} over {tp.size} tensor-parallel ranks")
    return x.narrow(-1, tp.rank * (width // tp.size), width // tp.size).contiguous()


def gather_along(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Every rank's `x` (all of one shape), concatenated along `dim` in rank order (no autograd)."""
    x = x.contiguous()
    out = torch.empty((tp.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    all_gather_into(out.view(-1), x.view(-1), tp.group, tp.counter, async_op=False)
    return torch.cat(out.unbind(0), dim=dim)


class PartialGradientSum:
    """A gradient hook for a whole parameter whose gradient each tp rank computes a part of (Note [partial
    gradients of whole parameters]): the parts summed over the tp group, before the gradient accumulates."""

    def __init__(self, tp: TPGroup):
        self.tp = tp

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, self.tp)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        if x._base is None and x.is_contiguous():  # a fresh layer output, no one else's view: sum in place
            ctx.mark_dirty(x)
            all_reduce_sum(x, tp.group, tp.counter, async_op=False)
            return x
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _split_last(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.tp, -1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return gather_along(x, tp, -1)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.tp), None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Forward: identity (every rank has the whole input). Backward: all-reduce (sum the ranks' partial grads)."""
    return _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Forward: all-reduce (sum the ranks' partial outputs). Backward: identity."""
    return _ReduceFromTP.apply(x, tp)


def split_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Forward: keep this rank's slice of the last dimension. Backward: all-gather the slices."""
    return _SplitToTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Forward: all-gather the ranks' slices along the last dimension. Backward: keep this rank's slice."""
    return _GatherFromTP.apply(x, tp)
