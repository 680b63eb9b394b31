"""Stateless collective helpers over chunk payloads, each in a profiler range, with byte counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

# The tensor collectives' names: torch 2.12 added the first of each pair, 2.11 has only the second.
ALL_GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor")
REDUCE_SCATTER_NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")


@dataclass(frozen=True)
class Collectives:
    """The tensor collectives the helpers below call, looked up once from a torch.distributed namespace.

    all_gather(output, input, group=, async_op=): every rank's `input` into `output`, rank by rank.
    reduce_scatter(output, input, op=, group=, async_op=): this rank's part of the reduced `input`."""

    all_gather: Callable
    reduce_scatter: Callable


def collectives_of(namespace) -> Collectives:
    """The tensor collectives of `namespace` (the torch.distributed module, or any object with its names):
    the 2.12+ names where present, else torch 2.11's. Raises naming the torch version needed."""
    return Collectives(_first(namespace, ALL_GATHER_NAMES), _first(namespace, REDUCE_SCATTER_NAMES))


def _first(namespace, names: tuple[str, ...]) -> Callable:
    for name in names:
        op = getattr(namespace, name, None)
        if op is not None:
            return op
    raise RuntimeError(f"torch.distributed has neither {' nor '.join(names)} (torch {torch.__version__} is "
                       f"running); Tiers needs torch 2.11 or newer: pip install 'torch>=2.11'")


def _torch_collectives() -> Collectives:
    return collectives_of(dist)


@dataclass
class CommCounter:
    """Payload bytes this rank handed to collectives: the tensor all-reduced or broadcast, the full
    input of a reduce-scatter, the full output of an all-gather; and the Collectives the helpers call.

    The collectives ride on the counter because every helper already receives one, from the run that
    made it (initialize's `collectives`): a run can use another namespace's collectives (an older torch's
    names, in tests) without a new argument on every helper, and without patching torch."""

    all_reduce_bytes: int = 0
    broadcast_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_gather_bytes: int = 0
    reduce_bytes: int = 0  # the tensor reduced to one rank (2D tensor parallelism)
    all_to_all_bytes: int = 0  # the input of an all-to-all (Ulysses attention)
    p2p_bytes: int = 0  # tensors sent to one peer (ring attention, pipeline stages)
    collectives: Collectives = field(default_factory=_torch_collectives, repr=False, compare=False, kw_only=True)

    @property
    def total_bytes(self) -> int:
        return (self.all_reduce_bytes + self.broadcast_bytes + self.reduce_scatter_bytes + self.all_gather_bytes
                + self.reduce_bytes + self.all_to_all_bytes + self.p2p_bytes)

    def ring_bytes(self, world: int) -> float:
        """Bytes each rank sends over a ring for these collectives: an all-reduce of n bytes sends
        2(w-1)/w·n, a reduce-scatter, all-gather or all-to-all of n bytes (w-1)/w·n, a broadcast or reduce n (at
        most), a point-to-point send n."""
        part = (world - 1) / world
        return ((2 * self.all_reduce_bytes + self.reduce_scatter_bytes + self.all_gather_bytes
                 + self.all_to_all_bytes) * part + self.broadcast_bytes + self.reduce_bytes + self.p2p_bytes)


def shard_range(numel: int, rank: int, count: int) -> tuple[int, int]:
    """(first element, length) of shard `rank` of `count` equal shards of `numel` elements: shard r is
    [r*n, (r+1)*n) with n = numel // count, the layout of every sharded chunk (numel divides by count)."""
    n = numel // count
    return rank * n, n


def shard_of(tensor: torch.Tensor, rank: int, count: int) -> torch.Tensor:
    """Shard `rank` of `count` of a flat tensor (a view; see shard_range)."""
    start, n = shard_range(tensor.numel(), rank, count)
    return tensor.narrow(0, start, n)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None, counter: CommCounter, *, async_op: bool):
    """Sums `tensor` in place over `group`; returns the Work handle when async_op."""
    counter.all_reduce_bytes += tensor.numel() * tensor.element_size()
    with record_function("tiers.comm.all_reduce"):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None, counter: CommCounter) -> None:
    """Takes the elementwise maximum of `tensor` in place over `group`."""
    counter.all_reduce_bytes += tensor.numel() * tensor.element_size()
    with record_function("tiers.comm.all_reduce"):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def reduce_sum_to(tensor: torch.Tensor, dst_group_rank: int, group: dist.ProcessGroup | None,
                  counter: CommCounter) -> None:
    """Sums `tensor` over `group` into the copy on group rank `dst_group_rank` (the others' are left as scratch)."""
    counter.reduce_bytes += tensor.numel() * tensor.element_size()
    dst = dist.get_global_rank(group, dst_group_rank) if group is not None else dst_group_rank
    with record_function("tiers.comm.reduce"):
        dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=group)


def broadcast_from(tensor: torch.Tensor, src_group_rank: int, group: dist.ProcessGroup | None,
                   counter: CommCounter) -> None:
    """Overwrites `tensor` on every rank of `group` with the copy on group rank `src_group_rank`."""
    counter.broadcast_bytes += tensor.numel() * tensor.element_size()
    src = dist.get_global_rank(group, src_group_rank) if group is not None else src_group_rank
    with record_function("tiers.comm.broadcast"):
        dist.broadcast(tensor, src=src, group=group)


def reduce_scatter_sum_in_place(chunk: torch.Tensor, group: dist.ProcessGroup | None, rank: int, world: int,
                                counter: CommCounter, *, async_op: bool):
    """Sums `chunk` over `group` into this rank's shard of it (chunk[rank*n/w:(rank+1)*n/w]); the other
    shards keep this rank's own values. numel must divide by `world`. See Note [reduce-scatter on gloo]."""
    counter.reduce_scatter_bytes += chunk.numel() * chunk.element_size()
    mine = shard_of(chunk, rank, world)
    shard = mine.numel()
    with record_function("tiers.comm.reduce_scatter"):
        if dist.get_backend(group) != "gloo":
            return counter.collectives.reduce_scatter(mine, chunk, op=dist.ReduceOp.SUM, group=group,
                                                      async_op=async_op)
        received = torch.empty_like(chunk)  # shard r of every rank's chunk, rank by rank
        work = dist.all_to_all_single(received, chunk, group=group, async_op=True)
        pending = _SumShardsWhenDone(work, received.view(world, shard), mine)
        if async_op:
            return pending
        pending.wait()
        return None


class _SumShardsWhenDone:
    """This rank's shard, summed from the pieces an all_to_all brought, once they are in.

    Note [reduce-scatter on gloo]
    gloo runs reduce_scatter as a full all-reduce (measured: 1.0x the
    payload per rank on the loopback, where an all_to_all sends 0.5x at 2 ranks), which would make ZeRO
    send 1.5x what DDP sends. So on gloo the shards are exchanged with all_to_all ((w-1)/w of the
    payload, as a ring reduce-scatter) and summed here, in rank order on every rank. Costs a transient
    buffer of the chunk's size while in flight."""

    def __init__(self, work, received: torch.Tensor, out: torch.Tensor):
        self._work, self._received, self._out = work, received, out

    def is_completed(self) -> bool:
        return self._received is None or self._work.is_completed()

    def wait(self) -> None:
        if self._received is None:
            return
        self._work.wait()
        with record_function("tiers.comm.reduce_scatter.sum"):
            torch.sum(self._received, dim=0, out=self._out)
        self._received = None


def all_gather_in_place(chunk: torch.Tensor, group: dist.ProcessGroup | None, rank: int, world: int,
                        counter: CommCounter, *, async_op: bool):
    """Every rank's shard of `chunk` (chunk[r*n/w:(r+1)*n/w] from rank r) into every rank's chunk."""
    counter.all_gather_bytes += chunk.numel() * chunk.element_size()
    with record_function("tiers.comm.all_gather"):
        return counter.collectives.all_gather(chunk, shard_of(chunk, rank, world), group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, counter: CommCounter,
                    *, async_op: bool):
    """Every rank's `shard` into `output` (rank r's at output[r*n:(r+1)*n]); output.numel() = world * n."""
    counter.all_gather_bytes += output.numel() * output.element_size()
    with record_function("tiers.comm.all_gather"):
        return counter.collectives.all_gather(output, shard, group=group, async_op=async_op)


def exchange_with(tensor: torch.Tensor, peer_group_rank: int, group: dist.ProcessGroup | None,
                  counter: CommCounter) -> torch.Tensor:
    """The peer's tensor of `tensor`'s shape, for this rank's (each sends its own to the other; the peer calls it
    with this rank): a new tensor, also on a rank that is its own peer (a copy). The group must have run a
    collective before (NCCL builds a group's communicator at its first collective, in which every rank takes part;
    a pair's exchange cannot be that first use)."""
    if dist.get_group_rank(group, dist.get_rank()) == peer_group_rank:
        return tensor.clone(memory_format=torch.contiguous_format)
    counter.p2p_bytes += tensor.numel() * tensor.element_size()
    peer = dist.get_global_rank(group, peer_group_rank)
    received = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    with record_function("tiers.comm.exchange"):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor.contiguous(), peer, group),
                                            dist.P2POp(dist.irecv, received, peer, group)]):
            work.wait()
    return received
