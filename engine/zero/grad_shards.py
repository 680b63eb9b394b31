"""ZeRO stage 2: gradient chunks live only while backward fills them; each rank keeps its shard.

Note [sharded gradients]
With gradients sharded (Note [sharding policy]) a rank keeps, between backward passes, only the
sum of its own shard of every gradient chunk: a persistent buffer of n/w elements per chunk (4Ψ/N
bytes in fp32). A chunk's full buffer exists only from the first gradient that reaches it in a
backward until its reduce-scatter has finished:
- a parameter's .grad is None when backward reaches it, so autograd hands it the gradient it
  computed without a copy; the post-accumulate hook then `accept`s it: the chunk gets its storage
  back (uninitialized: no pass over it), the gradient is copied into the parameter's view and
  .grad becomes that view. (Accumulating into zeroed views instead costs a zero-fill and an add
  per element, twice the memory traffic of the copy.)
- before the chunk's reduce-scatter, `complete` zeroes the views of the parameters that got no
  gradient in this backward, and the padding (the other ranks may have gradients there);
- when the reduce-scatter has finished, `retire` adds this rank's shard to the persistent
  buffer, drops the parameters' .grad (None, as DeepSpeed's stage 2 leaves them) and releases the
  storage (resized to 0: the views stay valid for the next backward).
Every backward reduces (gradient accumulation adds the shards micro-step by micro-step, as
DeepSpeed does), so `no_sync()` has nothing to skip and is refused.

Note [offloaded gradient shards]
With `offload_optimizer` the persistent shards live in the optimizer's ChunkManager (kind "grad",
one chunk per shard, homed where the states are), as ZeRO-Offload keeps gradients with the
optimizer: 4Ψ/N bytes that would otherwise stay in memory. The shard tensors become placeholders
(storage of size 0; .grad bindings keep their identity). `retire` accesses the shard's chunk, adds
and releases it; `zero` frees the chunks (a freed chunk comes back as zeros without any I/O). The
consumers stream through them: the global norm reads one shard at a time, and the optimizer
scales and steps each shard when it steps its parameter (Note [offloaded optimizer states]).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from engine.comm import shard_of, shard_range
from offload.chunk import Location
from offload.manager import ChunkManager
from offload.states import TensorState


class ShardedGrads:
    """The persistent gradient shards and the transient full gradient chunks of one rank."""

    def __init__(self, chunks: list[tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]], rank: int, world: int):
        """`chunks`: per gradient chunk, its payload and (parameter, view into the payload) pairs."""
        self._payloads = [payload for payload, _ in chunks]
        self._members = [members for _, members in chunks]
        self._view_of = [{id(p): view for p, view in members} for members in self._members]
        self._used = [sum(view.numel() for _, view in members) for members in self._members]  # padding after
        self._nbytes = [payload.untyped_storage().nbytes() for payload in self._payloads]
        self.rank, self.world = rank, world
        # a shard is "fresh" (logically zero) until its first retire after a zero(): no pass over it to zero it,
        # and no memory touched before the optimizer may move it into a manager
        self.shards = [torch.empty(shard_range(p.numel(), rank, world)[1], dtype=p.dtype, device=p.device)
                       for p in self._payloads]
        self._fresh = [True] * len(self._payloads)
        self._live = [False] * len(self._payloads)
        self.managed: list[int] | None = None  # the shards' manager chunks (Note [offloaded gradient shards])
        self._manager: ChunkManager | None = None
        self._compute = Location.CPU
        self._written: list[set[int]] = [set() for _ in self._payloads]  # ids of parameters with a gradient in
        for index in range(len(self._payloads)):
            self._release(index)

    def _materialize(self, index: int) -> None:
        if not self._live[index]:
            self._payloads[index].untyped_storage().resize_(self._nbytes[index])
            self._written[index].clear()
            self._live[index] = True

    def accept(self, index: int, p: nn.Parameter) -> None:
        """Moves the gradient autograd just gave `p` into its view of chunk `index` (p.grad becomes the view)."""
        view = self._view_of[index][id(p)]
        if p.grad is view:
            return
        self._materialize(index)
        if id(p) in self._written[index]:  # a second gradient for it in this backward (without the reducer armed)
            view.add_(p.grad)
        else:
            view.copy_(p.grad)
            self._written[index].add(id(p))
        p.grad = view

    def complete(self, index: int) -> torch.Tensor:
        """The chunk's full gradient buffer for its reduce-scatter: zeros where no gradient arrived."""
        self._materialize(index)
        payload = self._payloads[index]
        written = self._written[index]
        for p, view in self._members[index]:
            if id(p) not in written:
                view.zero_()
                p.grad = view
                written.add(id(p))
        payload.narrow(0, self._used[index], payload.numel() - self._used[index]).zero_()
        return payload

    def offload_to(self, manager: ChunkManager, home: Location, compute: Location) -> None:
        """Note [offloaded gradient shards]: the shards move into `manager`; the tensors become placeholders."""
        self._manager, self._compute = manager, compute
        self.managed = []
        for shard in self.shards:
            zeros = torch.zeros((), dtype=shard.dtype, device=shard.device).expand(shard.shape)  # no memory
            chunk = manager.register("grad", [zeros], location=home, capacity=shard.numel())[0].chunk
            manager.free(chunk)  # zeros, without a payload or a file
            shard.untyped_storage().resize_(0)
            self.managed.append(chunk)

    @contextlib.contextmanager
    def shard(self, index: int, writes: bool = True):
        """Shard `index`, wherever it lives, for the duration of the block."""
        if self.managed is None:
            yield self.shards[index]
            return
        with self._manager.accessed(self.managed[index], self._compute, writes=writes) as (view,):
            yield view

    def retire(self, index: int) -> None:
        """After the chunk's reduce-scatter: its shard of the sum joins the persistent buffer; the buffer goes."""
        mine = shard_of(self._payloads[index], self.rank, self.world)
        with self.shard(index) as shard:
            if self._fresh[index]:
                shard.copy_(mine)
            else:
                shard.add_(mine)
        self._fresh[index] = False
        self._release(index)

    def settle(self) -> None:
        """Before the shards are read: those no backward wrote since `zero` become real zeros."""
        for index, shard in enumerate(self.shards):
            if self._fresh[index] and self.managed is None:
                shard.zero_()
                self._fresh[index] = False

    def _release(self, index: int) -> None:
        for p, _ in self._members[index]:
            p.grad = None
        self._payloads[index].untyped_storage().resize_(0)
        self._live[index] = False

    def zero(self) -> None:
        """Zeroes the shards (lazily: Note [sharded gradients]) and drops any full chunk left live (a backward
        that raised half-way)."""
        for index in range(len(self.shards)):
            self._fresh[index] = True
            if self.managed is not None and self._manager.chunk(self.managed[index]).state is not TensorState.FREE:
                self._manager.free(self.managed[index])  # already FREE: it has held nothing since
            if self._live[index]:
                self._release(index)
