"""Point-to-point as NCCL runs it, for pipeline ranks that are threads of one test process.

    network = RendezvousNetwork(ranks)
    runner = PipelineRunner.over_modules(..., transport=network.endpoint(rank))  # in rank's thread
    ...                                                                           # network.leave(rank) at the end

What it keeps from NCCL, and gloo does not: tags are ignored, a rank's n-th send to a peer pairs with the peer's
n-th receive from it; a rank's batches run one at a time, in the order posted (one stream), and an operation
moves its bytes only while the batches holding it and its partner both run (a send waits for its receive: no
buffering). A pairing of tensors of another shape or dtype, or a state where every rank waits on a batch that
cannot run, fails every waiting rank at once with a report of each rank's running batch, instead of hanging.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch


@dataclass(eq=False)
class _Op:
    rank: int
    peer: int
    send: bool
    tensor: torch.Tensor
    batch: "_Batch"
    done: bool = False

    def __str__(self) -> str:
        way = "send to" if self.send else "receive from"
        return f"{way} {self.peer} {tuple(self.tensor.shape)} {self.tensor.dtype}"


@dataclass(eq=False)
class _Batch:
    network: "RendezvousNetwork"
    rank: int
    ops: list[_Op] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(op.done for op in self.ops)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.network._wait(self, timeout)
        return True


class RendezvousNetwork:
    def __init__(self, ranks: int):
        self.ranks = ranks
        self.error: str | None = None
        self._cond = threading.Condition()
        self._streams: list[list[_Batch]] = [[] for _ in range(ranks)]  # each rank's unfinished batches, in order
        self._sends: dict[tuple[int, int], list[_Op]] = {}  # (src, dst) -> src's sends to dst, in order
        self._receives: dict[tuple[int, int], list[_Op]] = {}  # (src, dst) -> dst's receives from src, in order
        self._paired: dict[tuple[int, int], int] = {}  # (src, dst) -> how many of the channel's ops have moved
        self._waiting: dict[int, _Batch] = {}
        self._left: set[int] = set()
        self.batches_posted = 0

    def endpoint(self, rank: int) -> "_Endpoint":
        return _Endpoint(self, rank)

    def leave(self, rank: int) -> None:
        """`rank` posts nothing more (its thread finished or failed)."""
        with self._cond:
            self._left.add(rank)
            self._check_deadlock()

    # ---- under the lock ------------------------------------------------------------------------
    def _post(self, rank: int, sends, receives) -> list[_Batch]:
        with self._cond:
            batch = _Batch(self, rank)
            for peer, tensor in sends:
                op = _Op(rank, peer, True, tensor, batch)
                batch.ops.append(op)
                self._sends.setdefault((rank, peer), []).append(op)
            for peer, tensor in receives:
                op = _Op(rank, peer, False, tensor, batch)
                batch.ops.append(op)
                self._receives.setdefault((peer, rank), []).append(op)
            self._streams[rank].append(batch)
            self.batches_posted += 1
            self._progress()
            return [batch]

    def _running(self, batch: _Batch) -> bool:
        stream = self._streams[batch.rank]
        return bool(stream) and stream[0] is batch

    def _progress(self) -> None:
        moved = True
        while moved and self.error is None:
            moved = False
            for channel, sends in self._sends.items():
                receives = self._receives.get(channel, [])
                n = self._paired.get(channel, 0)
                while n < min(len(sends), len(receives)) and self.error is None:
                    send, receive = sends[n], receives[n]
                    if not (self._running(send.batch) and self._running(receive.batch)):
                        break
                    if send.tensor.shape != receive.tensor.shape or send.tensor.dtype != receive.tensor.dtype:
                        self.error = (f"rank {send.rank}'s send #{n} to rank {receive.rank} "
                                      f"({tuple(send.tensor.shape)}, {send.tensor.dtype}) met a receive of "
                                      f"({tuple(receive.tensor.shape)}, {receive.tensor.dtype})")
                        break
                    receive.tensor.copy_(send.tensor)
                    send.done = receive.done = True
                    n += 1
                    moved = True
                    self._retire(send.batch.rank)
                    self._retire(receive.batch.rank)
                self._paired[channel] = n
        self._cond.notify_all()

    def _retire(self, rank: int) -> None:
        """Finished batches leave the stream; the next one starts running."""
        stream = self._streams[rank]
        while stream and stream[0].finished:
            stream.pop(0)

    def _check_deadlock(self) -> None:
        """Every rank either left or waits on a batch that cannot finish: nothing will ever move."""
        stuck = {r: b for r, b in self._waiting.items() if not b.finished}
        if self.error is None and len(stuck) + len(self._left - stuck.keys()) == self.ranks and stuck:
            heads = "; ".join(f"rank {r} runs [{', '.join(map(str, s[0].ops))}]" for r, s in enumerate(self._streams)
                              if s)
            self.error = f"deadlock: {heads}"
            self._cond.notify_all()

    def _wait(self, batch: _Batch, timeout: timedelta | None) -> None:
        limit = timeout.total_seconds() if timeout is not None else None
        with self._cond:
            self._waiting[batch.rank] = batch
            try:
                self._check_deadlock()
                if not self._cond.wait_for(lambda: batch.finished or self.error is not None, limit):
                    raise RuntimeError(f"rank {batch.rank}: no progress in {limit} s")
                if self.error is not None:
                    raise RuntimeError(self.error)
            finally:
                del self._waiting[batch.rank]


@dataclass
class _Endpoint:
    network: RendezvousNetwork
    rank: int

    def post(self, sends, receives) -> list:
        return self.network._post(self.rank, sends, receives)
