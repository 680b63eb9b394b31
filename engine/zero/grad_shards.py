"""ZeRO stage 2: gradient chunks live only while backward fills them; each rank keeps its shard.

Note [sharded gradients]
With gradients sharded (Note [sharding policy]) a rank keeps, between backward passes, only the
sum of its own shard of every gradient chunk: a persistent buffer of n/w elements per chunk (4Ψ/N
bytes in fp32). A chunk's full buffer exists only from the first gradient that reaches it in a
backward until its reduce-scatter has finished:
- before autograd accumulates a parameter's gradient (a tensor pre-hook), `materialize` gives the
  chunk its storage back (zeroed) and points every one of its parameters' .grad at its view, so
  autograd accumulates in place, as in stage 0;
- when the chunk's reduce-scatter has finished, `retire` adds this rank's shard to the persistent
  buffer, drops the parameters' .grad (None, as DeepSpeed's stage 2 leaves them) and releases the
  storage (resized to 0: the views stay valid for the next materialize).
Every backward reduces (gradient accumulation adds the shards micro-step by micro-step, as
DeepSpeed does), so `no_sync()` has nothing to skip and is refused.
"""

from __future__ import annotations

import torch
from torch import nn


class ShardedGrads:
    """The persistent gradient shards and the transient full gradient chunks of one rank."""

    def __init__(self, chunks: list[tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]], rank: int, world: int):
        """`chunks`: per gradient chunk, its payload and (parameter, view into the payload) pairs."""
        self._payloads = [payload for payload, _ in chunks]
        self._members = [members for _, members in chunks]
        self._nbytes = [payload.untyped_storage().nbytes() for payload in self._payloads]
        self.rank, self.world = rank, world
        self.shards = [torch.zeros(p.numel() // world, dtype=p.dtype, device=p.device) for p in self._payloads]
        self._live = [False] * len(self._payloads)
        for index in range(len(self._payloads)):
            self._release(index)

    def materialize(self, index: int) -> torch.Tensor:
        """The chunk's full gradient buffer, zeroed and wired to its parameters' .grad (no-op when live)."""
        payload = self._payloads[index]
        if not self._live[index]:
            payload.untyped_storage().resize_(self._nbytes[index])
            payload.zero_()
            for p, view in self._members[index]:
                p.grad = view
            self._live[index] = True
        return payload

    def retire(self, index: int) -> None:
        """After the chunk's reduce-scatter: its shard of the sum joins the persistent buffer; the buffer goes."""
        payload = self._payloads[index]
        n = payload.numel() // self.world
        self.shards[index].add_(payload.narrow(0, self.rank * n, n))
        self._release(index)

    def _release(self, index: int) -> None:
        for p, _ in self._members[index]:
            p.grad = None
        self._payloads[index].untyped_storage().resize_(0)
        self._live[index] = False

    def zero(self) -> None:
        """Zeroes the shards and drops any full chunk left live (a backward that raised half-way)."""
        for index, shard in enumerate(self.shards):
            shard.zero_()
            if self._live[index]:
                self._release(index)
