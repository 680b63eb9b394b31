"""Stateless collective helpers over chunk payloads, each in a profiler range, with byte counts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function


@dataclass
class CommCounter:
    """Payload bytes this rank handed to collectives (what DDP's buckets would carry)."""

    all_reduce_bytes: int = 0
    broadcast_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.all_reduce_bytes + self.broadcast_bytes


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None, counter: CommCounter, *, async_op: bool):
    """Sums `tensor` in place over `group`; returns the Work handle when async_op."""
    counter.all_reduce_bytes += tensor.numel() * tensor.element_size()
    with record_function("tiers.comm.all_reduce"):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def broadcast_from(tensor: torch.Tensor, src_group_rank: int, group: dist.ProcessGroup | None, counter: CommCounter) -> None:
    """Overwrites `tensor` on every rank of `group` with the copy on group rank `src_group_rank`."""
    counter.broadcast_bytes += tensor.numel() * tensor.element_size()
    src = dist.get_global_rank(group, src_group_rank) if group is not None else src_group_rank
    with record_function("tiers.comm.broadcast"):
        dist.broadcast(tensor, src=src, group=group)
