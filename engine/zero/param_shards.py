"""ZeRO stage 3: each rank keeps its shard of every parameter chunk; full chunks exist only while gathered (under
stages 0-2 the degenerate layout: each chunk's one shard is its whole payload).

Note [sharded parameters]
With parameters sharded (Note [sharding policy]) a rank keeps, between uses, only its own shard of
every parameter chunk: a persistent tensor of n/w elements per chunk (4Ψ/N bytes in fp32), which
is what the optimizer steps. The chunk's full payload keeps its shape, and every parameter's
.data stays a view into it, but its storage is resized to 0 while the chunk is released:
- the chunk's `gather` gives the storage its bytes back and all-gathers every rank's shard into it
  (its phase goes SHARDED → GATHERING, and → GATHERED once `wait`ed for: Note [chunk phases]);
- its `release` resizes the storage to 0 again (→ SHARDED).
The shard (in its ShardStore: Note [shard stores]), the aliasing writer below and the gather in
flight are kept in the chunk's ChunkState, whose methods these are.
Tensors autograd saved in forward (a linear's weight) are views of that same storage, so a chunk
gathered again before backward needs them shows them its values again. A parameter used while its
chunk is released (read outside its module's forward) has no memory behind it: most operators then
raise ("... out of bounds for storage of size 0", "... data is not allocated"), which the engine
turns into an error naming the fix, but some CPU kernels read the missing memory and crash the
process — as with DeepSpeed's and FSDP's released parameters.
The gather writes through a second tensor aliasing the storage but with its own version counter:
an in-place write through the payload itself would bump the parameters' versions and make
autograd reject the tensors it saved in forward.
Chunks of parameters below `stage3_param_persistence_threshold` are persistent (phase WHOLE): always
gathered, their shard a view of the payload (as in stage 1), all-gathered after each update.

Note [offloaded parameter shards]
With `offload_param` the shards of non-persistent chunks live in the ChunkManager (kind "param", one
manager chunk per shard, homed on CPU or NVMe; its handle is the state's `param_handle`). The shard
tensor keeps its identity (the optimizer's param groups and .grad hold it) but its storage is
resized to 0: it is a placeholder. A gather `access`es the manager chunk read-only (writes=False:
an NVMe copy stays current, so eviction drops it without a write), copies it into this rank's slot
of the full chunk and releases it before the all-gather starts, so gathers in flight pin nothing in
the manager; the optimizer steps the manager's view in place of the placeholder
(Note [offloaded optimizer states]).

Note [paging in one process]
One device is the most common reason to offload, so `offload_param` works with a data-parallel
world of one too: ChunkedParams is built with `page_params`, which keeps stage 3's machinery with a
single shard per chunk — the whole chunk. Each shard lives in the ChunkManager (CPU or NVMe), a
"gather" copies it into the chunk's storage instead of an all-gather, and the same gatherer hooks
page it in before the modules that use it run, ahead of them by the recorded trace, and release it
after; the GradReducer, with no peers, retires each complete gradient chunk into its managed
shard at once (Note [offloaded gradient shards]) and the chunk's parameters are released in
backward as on many ranks. Between uses only persistent chunks (below the persistence threshold)
stay in memory. Nothing else changes: the optimizer, checkpoints and the global norm see one rank
whose shards are its chunks.
"""

from __future__ import annotations

from typing import ContextManager

import torch
import torch.distributed as dist

from engine.comm import CommCounter, shard_of, shard_range
from engine.zero.chunk_state import ChunkPhase, ChunkState
from engine.zero.shard_store import MemoryStore, manage
from offload.chunk import Location
from offload.manager import ChunkManager


class ShardedParams:
    """The persistent parameter shards and the transient full parameter chunks of one rank, kept in the
    chunks' states: each non-persistent chunk cycles SHARDED → GATHERING → GATHERED (Note [chunk phases])."""

    def __init__(self, states: list[ChunkState], placeholders: bool = False, gathers: bool = True):
        """The shards start uninitialized: the runtime's start (or zero_init) writes them (Note [a bounded start]);
        placeholders=True: with no storage either, for shards a chunk manager will hold. Each chunk is sharded as
        its `place` says. gathers=False: the degenerate layout of stages 0-2 (Note [stage predicates]): every
        chunk is WHOLE, as a persistent one is, and its shard is a view of its payload, so nothing is allocated,
        gathered or released."""
        self.states = states
        self.gathers = gathers
        for state in states:
            payload = state.param_chunk.payload
            if state.int8 is not None and (state.persistent or not gathers):
                raise ValueError(f"chunk {state.index}: int8 frozen chunks are gathered around their use, so they "
                                 "need gathered (stage 3 or paged) chunks that are not persistent")
            if state.persistent or not gathers:
                # a view: always holds
                state.param_store = MemoryStore(shard_of(payload, state.place.rank, state.place.count))
                continue
            storage = payload.untyped_storage()  # released (Note [a bounded start]): set_ would allocate it
            state.writer = torch.empty(0, dtype=payload.dtype, device=payload.device)
            state.writer.set_(storage, payload.storage_offset(), (payload.numel(),))
            storage.resize_(0)
            n = shard_range(payload.numel(), state.place.rank, state.place.count)[1]
            dtype = payload.dtype if state.int8 is None else torch.int8  # Note [int8 frozen chunks]
            state.param_store = MemoryStore(torch.empty(n, dtype=dtype, device=payload.device))
            if placeholders:
                state.param_shard.untyped_storage().resize_(0)
        # the chunks that cycle SHARDED → GATHERING → GATHERED (none in the degenerate layout)
        self.transient = tuple(i for i, s in enumerate(states) if s.phase is not ChunkPhase.WHOLE)
        # elements of transient chunks not released (gathered or gathering): kept, not summed per demand
        self.live_numel = sum(states[i].numel for i in self.transient)
        self._manager: ChunkManager | None = None  # Note [offloaded parameter shards]
        self.gathered_bytes = 0  # full-chunk bytes of the gathers started so far (reads of parameters per step)

    @property
    def shards(self) -> list[torch.Tensor]:
        """This rank's shard of every chunk (what the optimizer steps; placeholders when offloaded)."""
        return [s.param_shard for s in self.states]

    @property
    def persistent(self) -> list[bool]:
        """Whether each chunk is never released (WHOLE: its shard is a view of its payload)."""
        return [s.phase is ChunkPhase.WHOLE for s in self.states]

    def offload_to(self, manager: ChunkManager, home: Location) -> None:
        """Moves every non-persistent shard into `manager` on `home`; the shard tensors become placeholders, used
        where the manager says (Note [where a chunk is used])."""
        self._manager = manager
        for state in (self.states[i] for i in self.transient):
            # values still to come (the start or zero_init writes them): registered as zeros, no memory or I/O;
            # frozen shards as a kind of their own, whose writes the manager counts apart (Note [frozen chunks])
            state.param_store = manage(state.param_store, manager, "frozen" if state.frozen else "param", home)

    def settle_frozen(self) -> None:
        """Once the frozen chunks hold their starting values: offloaded shards go to their home tier, written there
        once; from here on they are only read, and a page-out is a drop (Note [frozen chunks])."""
        if self._manager is None:
            return
        for state in (self.states[i] for i in self.transient):
            if state.frozen:
                state.param_store.settle_home()

    def shard(self, index: int, writes: bool) -> ContextManager[torch.Tensor]:
        """This rank's shard of chunk `index`, wherever it lives, for the duration of the block."""
        return self.states[index].param_store.access(writes)

    def placed_shard(self, index: int, writes: bool) -> ContextManager[tuple[torch.Tensor, Location]]:
        """(this rank's shard of chunk `index`, the tier it is on: DEVICE when in memory) for the block."""
        return self.states[index].param_store.placed(writes)

    def __len__(self) -> int:
        return len(self.states)

    def numel(self, index: int) -> int:
        return self.states[index].numel

    def take_shard(self, index: int) -> None:
        """Once full chunk `index` holds its starting values (rank 0's, after the start-up broadcast): keep this
        rank's shard of it and release the rest."""
        self.states[index].take_shard()
        self.release(index)

    def refresh_shard(self, index: int) -> None:
        """After the gathered chunk was modified (the same way on every rank): keep the new values."""
        self.states[index].refresh_shard()

    def gather(self, index: int, group: dist.ProcessGroup | None, counter: CommCounter) -> bool:
        """Starts gathering chunk `index` if released (Note [chunk phases]); returns whether a gather started."""
        state = self.states[index]
        if not state.gather(group, counter):
            return False
        self.live_numel += state.numel
        self.gathered_bytes += state.param_chunk.nbytes
        return True

    def wait(self, index: int) -> None:
        self.states[index].wait()

    def release(self, index: int) -> None:
        """Frees a non-persistent chunk's full storage (waiting for its gather first, if one is in flight)."""
        state = self.states[index]
        if state.release():
            self.live_numel -= state.numel

    def is_released(self, index: int) -> bool:
        return self.states[index].phase is ChunkPhase.SHARDED

    def shard_bytes(self) -> int:
        """Bytes of the in-memory shards that are tensors of their own (persistent chunks' shards are payload
        views; offloaded shards are counted by their manager), and int8 chunks' scales (Note [int8 frozen chunks])."""
        return sum(self.states[i].param_shard.untyped_storage().nbytes()
                   + (self.states[i].int8.nbytes if self.states[i].int8 is not None else 0) for i in self.transient)

    def stepped_chunks(self) -> dict[int, int]:
        """id(shard tensor) -> its manager chunk, for the offloaded shards (the optimizer steps those views)."""
        return {id(s.param_shard): s.param_handle for s in self.states if s.param_handle is not None and not s.frozen}
