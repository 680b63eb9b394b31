"""ZeRO stage 2: gradient chunks live only while backward fills them; each rank keeps its shard (under stages 0-1
the degenerate layout: each chunk's one shard is its whole gradient chunk).

Note [sharded gradients]
With gradients sharded (Note [sharding policy]) a rank keeps, between backward passes, only the
sum of its own shard of every gradient chunk: a persistent buffer of n/w elements per chunk (4Ψ/N
bytes in fp32). A chunk's full buffer exists only from the first gradient that reaches it in a
backward until its reduce-scatter has finished:
- a parameter's .grad is None when backward reaches it, so autograd hands it the gradient it
  computed without a copy; the post-accumulate hook then has the chunk `accept_grad` it: the chunk gets its storage
  back (uninitialized: no pass over it), the gradient is copied into the parameter's view and
  .grad becomes that view. (Accumulating into zeroed views instead costs a zero-fill and an add
  per element, twice the memory traffic of the copy.)
- before the chunk's reduce-scatter, its `complete_grads` zeroes the views of the parameters that got no
  gradient in this backward, and the padding (the other ranks may have gradients there);
- when the reduce-scatter has finished, its `retire` adds this rank's shard to the persistent
  buffer, drops the parameters' .grad (None, as DeepSpeed's stage 2 leaves them) and releases the
  storage (resized to 0: the views stay valid for the next backward).
Every backward reduces (gradient accumulation adds the shards micro-step by micro-step, as
DeepSpeed does), so `no_sync()` has nothing to skip and is refused.
The chunk's ChunkState (Note [chunk phases]) records where it is in this: `grad_live` (the full
buffer has storage), `written` (members whose view holds a gradient), `grad_fresh` (the shard has
not been written since `zero`: logically zero).

Note [offloaded gradient shards]
With `offload_optimizer` the persistent shards live in the optimizer's ChunkManager (kind "grad",
one chunk per shard, homed where the states are; its handle is the state's `grad_handle`), as
ZeRO-Offload keeps gradients with the optimizer: 4Ψ/N bytes that would otherwise stay in memory. The
shard tensors become placeholders (storage of size 0; .grad bindings keep their identity). `retire`
accumulates through the shard's ShardStore (Note [shard stores]); `zero` frees the chunks (a freed
chunk comes back as zeros without any I/O). The consumers stream through them: the global norm
reads one shard at a time, and the optimizer scales and steps each shard when it steps its parameter
(Note [offloaded optimizer states]).
"""

from __future__ import annotations

from typing import ContextManager

import torch
from torch import nn

from engine.comm import shard_of, shard_range
from engine.zero.chunk_state import ChunkState
from engine.zero.shard_store import MemoryStore, manage
from offload.chunk import Location
from offload.manager import ChunkManager


class ShardedGrads:
    """The persistent gradient shards and the transient full gradient chunks of one rank, kept in the chunks'
    states (Note [chunk phases]): the shard, whether the full buffer is live, which members wrote it."""

    def __init__(self, states: list[ChunkState], placeholders: bool = False, sharded: bool = True):
        """Each chunk is sharded as its `place` says; placeholders=True: the shards have no storage from the start,
        for a chunk manager to hold them (Note [a bounded start]). sharded=False: the degenerate layout of stages
        0-1 (Note [stage predicates]): each chunk's shard is a view of its whole gradient chunk, which always holds
        and which backward accumulates into; nothing is allocated, completed, retired or released."""
        self.states = states
        self.sharded = sharded
        self._manager: ChunkManager | None = None  # Note [offloaded gradient shards]
        if not sharded:
            for state in states:
                state.grad_store = MemoryStore(shard_of(state.grad_chunk.payload, state.place.rank, state.place.count))
                state.grad_fresh = False  # the chunk holds real values (zeros after `zero`)
            return
        # a shard is "fresh" (logically zero) until its first retire after a zero(): no pass over it to zero it,
        # and no memory touched before the optimizer may move it into a manager
        for state in states:
            state.shards_grads = True
            payload = state.grad_chunk.payload
            state.grad_store = MemoryStore(torch.empty(shard_range(payload.numel(), 0, state.place.count)[1],
                                                       dtype=payload.dtype, device=payload.device))
            if placeholders:
                state.grad_shard.untyped_storage().resize_(0)
            state.grad_fresh = True
        for state in states:
            state.release_grads()

    @property
    def shards(self) -> list[torch.Tensor]:
        """This rank's gradient shard of every chunk (placeholders when offloaded)."""
        return [s.grad_shard for s in self.states]

    def shard_bytes(self) -> int:
        """Bytes of the in-memory shards that are tensors of their own (the degenerate layout's are the gradient
        chunks; offloaded shards are counted by their manager)."""
        return sum(s.grad_shard.untyped_storage().nbytes() for s in self.states) if self.sharded else 0

    @property
    def managed(self) -> list[int] | None:
        """The shards' manager chunks (Note [offloaded gradient shards]); None while in memory."""
        return None if self._manager is None else [s.grad_handle for s in self.states]

    def accept(self, index: int, p: nn.Parameter) -> None:
        """Moves the gradient autograd just gave `p` into its view of chunk `index` (p.grad becomes the view)."""
        self.states[index].accept_grad(p)

    def complete(self, index: int) -> torch.Tensor:
        """The chunk's full gradient buffer for its reduce-scatter: zeros where no gradient arrived."""
        return self.states[index].complete_grads()

    def offload_to(self, manager: ChunkManager, homes: list[Location]) -> None:
        """Note [offloaded gradient shards]: shard i moves into `manager` on homes[i]; the tensors become
        placeholders, used where the manager says (Note [where a chunk is used])."""
        self._manager = manager
        for state, home in zip(self.states, homes):
            state.grad_store = manage(state.grad_store, manager, "grad", home)  # zeros, without a payload or a file

    def shard(self, index: int, writes: bool = True) -> ContextManager[torch.Tensor]:
        """Shard `index`, wherever it lives, for the duration of the block."""
        return self.states[index].grad_store.access(writes)

    def retire(self, index: int) -> None:
        """After the chunk's reduce-scatter: its shard of the sum joins the persistent buffer; the buffer goes."""
        self.states[index].retire()

    def settle(self) -> None:
        """Before the shards are read: those no backward wrote since `zero` become real zeros (the degenerate
        layout's chunks are real always)."""
        if not self.sharded:
            return
        for state in self.states:
            if state.grad_fresh and state.grad_handle is None:
                state.grad_shard.zero_()
                state.grad_fresh = False

    def zero(self) -> None:
        """Zeroes the shards (lazily: Note [sharded gradients]) and drops any full chunk left live (a backward
        that raised half-way)."""
        for state in self.states:
            state.zero_grad_shard()
