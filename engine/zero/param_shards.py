"""ZeRO stage 3: each rank keeps its shard of every parameter chunk; full chunks exist only while gathered.

Note [sharded parameters]
With parameters sharded (Note [sharding policy]) a rank keeps, between uses, only its own shard of
every parameter chunk: a persistent tensor of n/w elements per chunk (4Ψ/N bytes in fp32), which
is what the optimizer steps. The chunk's full payload keeps its shape, and every parameter's
.data stays a view into it, but its storage is resized to 0 while the chunk is released:
- `gather` gives the storage its bytes back and all-gathers every rank's shard into it;
- `release` resizes the storage to 0 again.
Tensors autograd saved in forward (a linear's weight) are views of that same storage, so a chunk
gathered again before backward needs them shows them its values again. A parameter used while its
chunk is released (read outside its module's forward) has no memory behind it: most operators then
raise ("... out of bounds for storage of size 0", "... data is not allocated"), which the engine
turns into an error naming the fix, but some CPU kernels read the missing memory and crash the
process — as with DeepSpeed's and FSDP's released parameters.
The gather writes through a second tensor aliasing the storage but with its own version counter:
an in-place write through the payload itself would bump the parameters' versions and make
autograd reject the tensors it saved in forward.
Chunks of parameters below `stage3_param_persistence_threshold` are persistent: always gathered,
their shard a view of the payload (as in stage 1), all-gathered after each update.

Note [offloaded parameter shards]
With `offload_param` the shards of non-persistent chunks live in the ChunkManager (kind "param", one
manager chunk per shard, homed on CPU or NVMe). The shard tensor keeps its identity (the optimizer's
param groups and .grad hold it) but its storage is resized to 0: it is a placeholder. A gather
`access`es the manager chunk read-only (writes=False: an NVMe copy stays current, so eviction drops
it without a write), copies it into this rank's slot of the full chunk and releases it before the
all-gather starts, so gathers in flight pin nothing in the manager; the optimizer steps the
manager's view in place of the placeholder (Note [offloaded optimizer states]).
"""

from __future__ import annotations

import contextlib
import enum

import torch
import torch.distributed as dist

from engine.comm import CommCounter, all_gather_into, shard_of
from offload.chunk import Location
from offload.manager import ChunkManager


class Residency(enum.Enum):
    RELEASED = "released"    # storage of size 0; only the shard holds this rank's values
    GATHERING = "gathering"  # storage back, all-gather in flight
    GATHERED = "gathered"    # full values in the payload


class ShardedParams:
    """The persistent parameter shards and the transient full parameter chunks of one rank."""

    def __init__(self, payloads: list[torch.Tensor], persistent: list[bool], rank: int, world: int,
                 copy_payloads: bool = True):
        """copy_payloads=False: the shards start uninitialized (zero_init writes them; the payloads hold nothing)."""
        self._payloads = payloads
        self.persistent = persistent
        self.rank, self.world = rank, world
        self._nbytes = [p.untyped_storage().nbytes() for p in payloads]
        self._writers = [torch.empty(0, dtype=p.dtype, device=p.device).set_(p.untyped_storage(), p.storage_offset(),
                                                                           (p.numel(),)) for p in payloads]
        self.shards = [self._own(p) if keep else self._own(p).clone() if copy_payloads else torch.empty_like(self._own(p))
                       for p, keep in zip(payloads, persistent)]
        self._copied = copy_payloads
        self.residency = [Residency.GATHERED] * len(payloads)
        # elements of non-persistent chunks not released (gathered or gathering): kept, not summed per demand
        self.live_numel = sum(p.numel() for p, keep in zip(payloads, persistent) if not keep)
        self._works: dict[int, object] = {}
        self._manager: ChunkManager | None = None  # Note [offloaded parameter shards]
        self._compute = Location.CPU
        self.managed: list[int | None] = [None] * len(payloads)  # each shard's manager chunk

    def offload_to(self, manager: ChunkManager, home: Location, compute: Location) -> None:
        """Moves every non-persistent shard into `manager` on `home`; the shard tensors become placeholders."""
        self._manager, self._compute = manager, compute
        for index, shard in enumerate(self.shards):
            if not self.persistent[index]:
                # values still to come (zero_init loads them through shard()): registered as zeros, no memory
                values = shard if self._copied else torch.zeros((), dtype=shard.dtype).expand(shard.shape)
                self.managed[index] = manager.register("param", [values], location=home, capacity=shard.numel())[0].chunk
                shard.untyped_storage().resize_(0)

    @contextlib.contextmanager
    def shard(self, index: int, writes: bool):
        """This rank's shard of chunk `index`, wherever it lives, for the duration of the block."""
        if self.managed[index] is None:
            yield self.shards[index]
            return
        with self._manager.accessed(self.managed[index], self._compute, writes=writes) as (view,):
            yield view

    def __len__(self) -> int:
        return len(self._payloads)

    def numel(self, index: int) -> int:
        return self._payloads[index].numel()

    def _own(self, payload: torch.Tensor) -> torch.Tensor:
        return shard_of(payload, self.rank, self.world)

    def take_shards(self) -> None:
        """Once the full chunks hold the starting values (rank 0's, after the start-up broadcast): keep
        this rank's shard of each and release the rest."""
        for index, payload in enumerate(self._payloads):
            if not self.persistent[index]:
                with self.shard(index, writes=True) as shard:
                    shard.copy_(self._own(payload))
                self.release(index)

    def release_loaded(self) -> None:
        """zero_init wrote the shards directly (the full chunks never held values): release the chunks."""
        for index in range(len(self._payloads)):
            self.release(index)

    def refresh_shard(self, index: int) -> None:
        """After the gathered chunk was modified (the same way on every rank): keep the new values."""
        if not self.persistent[index]:
            with self.shard(index, writes=True) as shard:
                shard.copy_(self._own(self._writers[index]))

    def gather(self, index: int, group: dist.ProcessGroup | None, counter: CommCounter) -> bool:
        """Starts gathering a released chunk (a collective: every rank must gather the same chunks in the
        same order). Returns whether a gather was started."""
        if self.residency[index] is not Residency.RELEASED:
            return False
        writer = self._writers[index]
        writer.untyped_storage().resize_(self._nbytes[index])
        if self.managed[index] is None:
            shard = self.shards[index]
        else:  # copied into its own slot of the output at once: the manager chunk is not held while in flight
            shard = self._own(writer)
            with self.shard(index, writes=False) as view:
                shard.copy_(view)
        self._works[index] = all_gather_into(writer, shard, group, counter, async_op=True)
        self.residency[index] = Residency.GATHERING
        self.live_numel += writer.numel()
        return True

    def wait(self, index: int) -> None:
        if self.residency[index] is Residency.GATHERING:
            self._works.pop(index).wait()
            self.residency[index] = Residency.GATHERED

    def release(self, index: int) -> None:
        """Frees a non-persistent chunk's full storage (waiting for its gather first, if one is in flight)."""
        if self.persistent[index] or self.residency[index] is Residency.RELEASED:
            return
        self.wait(index)
        self._writers[index].untyped_storage().resize_(0)
        self.residency[index] = Residency.RELEASED
        self.live_numel -= self._payloads[index].numel()

    def is_released(self, index: int) -> bool:
        return self.residency[index] is Residency.RELEASED

    def shard_bytes(self) -> int:
        """Bytes of the in-memory shards that are tensors of their own (persistent chunks' shards are payload
        views; offloaded shards are counted by their manager)."""
        return sum(s.untyped_storage().nbytes() for s, keep in zip(self.shards, self.persistent) if not keep)

    def stepped_chunks(self) -> dict[int, int]:
        """id(shard tensor) -> its manager chunk, for the offloaded shards (the optimizer steps those views)."""
        return {id(s): c for s, c in zip(self.shards, self.managed) if c is not None}
