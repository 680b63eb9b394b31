"""The variable-split all-to-all that moves tokens to their experts and back (Note [expert parallelism]).

Mirror pair in one function: forward sends `send_splits[r]` rows to rank r and receives `recv_splits[r]` rows
from it; backward sends the gradients back the same way reversed."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from engine.comm import CommCounter


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup | None, counter: CommCounter) -> torch.Tensor:
    """counts [ep, n] (row r: what this rank sends to rank r) -> [ep, n] (row r: what rank r sends to this rank)."""
    received = torch.empty_like(counts)
    counter.all_to_all_bytes += counts.numel() * counts.element_size()
    with record_function("tiers.moe.exchange_counts"):
        dist.all_to_all_single(received, counts, group=group)
    return received


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group, counter: CommCounter) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    counter.all_to_all_bytes += x.numel() * x.element_size()
    with record_function("tiers.moe.all_to_all"):
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """forward: rows to the ranks `send` says, rows from the ranks `recv` says; backward: the reverse."""

    @staticmethod
    def forward(ctx, x, send, recv, group, counter):
        ctx.send, ctx.recv, ctx.group, ctx.counter = send, recv, group, counter
        return _all_to_all(x, send, recv, group, counter)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.counter), None, None, None, None


def exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None,
                  counter: CommCounter) -> torch.Tensor:
    """x [sum(send), ...] -> [sum(recv), ...]: rows send[r] go to rank r of `group`, recv[r] come from it."""
    return _Exchange.apply(x, send, recv, group, counter)
