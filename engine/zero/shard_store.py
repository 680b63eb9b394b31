"""Where one of a chunk's per-rank tensors keeps its values: in memory, or in a chunk manager.

Note [shard stores]
Every per-rank tensor ZeRO keeps for a chunk — its parameter shard (Note [sharded parameters]), its
gradient shard (Note [sharded gradients]), its fp32 master (Note [master weights]) — is read and
written through one ShardStore, whichever tier holds it:
- `MemoryStore`: the tensor itself holds the values, on the compute device;
- `ManagedStore`: a chunk of a ChunkManager holds them (Notes [offloaded parameter shards],
  [offloaded gradient shards], [offloaded master weights]); the tensor stays as a placeholder
  (storage of size 0) that keeps its identity, since optimizer param groups and .grad bindings hold it.
Code that uses such a tensor asks its store for it (`placed(writes)`: the values and the tier they
are on, for the duration of a block) instead of asking whether it is offloaded; `handle` is the
manager chunk (None in memory), for the offloaded optimizer, which steps manager views directly.
A store is made once per tensor, when the tensor gets its home: in memory from the start, replaced by
a ManagedStore when a chunk manager takes it (`manage`).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol

import torch

from engine.comm import shard_of
from offload.chunk import Location
from offload.manager import ChunkManager
from offload.states import TensorState


class ShardStore(Protocol):
    """One per-rank tensor of a chunk, wherever its values live (Note [shard stores])."""

    tensor: torch.Tensor  # the tensor the optimizer and .grad bindings hold (a placeholder when managed)
    handle: int | None  # its manager chunk; None in memory

    def placed(self, writes: bool) -> ContextManager[tuple[torch.Tensor, Location]]:
        """(the values, the tier they are on) for the duration of the block."""

    def access(self, writes: bool) -> ContextManager[torch.Tensor]:
        """The values for the duration of the block."""

    def placed_on(self, tier: Location, writes: bool) -> ContextManager[torch.Tensor]:
        """The values, brought to `tier` for the duration of the block."""

    def location(self) -> Location:
        """The tier the values are on now."""

    def forget(self) -> None:
        """The values become zeros at no cost where the store can do that (a manager chunk is freed)."""

    def on_device(self, full: torch.Tensor, rank: int, count: int) -> torch.Tensor:
        """The values on the compute device: the tensor itself in memory, else copied into shard `rank` of `count` of
        the device tensor `full`, and that shard returned; nothing stays held in a manager once this returns."""

    def write_home(self, values: torch.Tensor) -> None:
        """`values` (on the compute device) become the store's, written straight to where they rest (a start
        puts nothing on the device tier: Note [a bounded start])."""

    def accumulate(self, values: torch.Tensor, first: bool) -> None:
        """Adds `values` (on the compute device, in the store's dtype) to the store's; first: replaces them."""


class MemoryStore:
    """The tensor itself holds the values (on the compute device)."""

    handle = None

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def placed(self, writes: bool) -> ContextManager[tuple[torch.Tensor, Location]]:
        return contextlib.nullcontext((self.tensor, Location.DEVICE))

    def access(self, writes: bool) -> ContextManager[torch.Tensor]:
        return contextlib.nullcontext(self.tensor)

    def placed_on(self, tier: Location, writes: bool) -> ContextManager[torch.Tensor]:
        return contextlib.nullcontext(self.tensor)

    def location(self) -> Location:
        return Location.DEVICE

    def forget(self) -> None:
        """In memory a tensor holds what it holds: its owner zeroes it when it must read as zeros."""

    def on_device(self, full: torch.Tensor, rank: int, count: int) -> torch.Tensor:
        return self.tensor

    def write_home(self, values: torch.Tensor) -> None:
        self.tensor.copy_(values)

    def accumulate(self, values: torch.Tensor, first: bool) -> None:
        if first:
            self.tensor.copy_(values)
        else:
            self.tensor.add_(values)


class ManagedStore:
    """A chunk of a ChunkManager holds the values; the tensor is a placeholder keeping its identity."""

    def __init__(self, tensor: torch.Tensor, manager: ChunkManager, kind: str, home: Location):
        """Registers `tensor`'s shape with `manager` as a chunk of `kind` on `home`, as zeros (no memory or I/O until
        written), and releases the tensor's storage."""
        self.tensor, self.manager, self.home = tensor, manager, home
        zeros = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)  # only the shape counts
        self.handle: int = manager.register(kind, [zeros], location=home, capacity=tensor.numel(),
                                            zeros=True)[0].chunk
        tensor.untyped_storage().resize_(0)

    @contextlib.contextmanager
    def placed(self, writes: bool, overwrites: bool = False):
        """overwrites: the caller writes every element before it reads any (ChunkManager.access)."""
        tier = self.manager.use_tier(self.handle)
        with self.manager.accessed(self.handle, tier, writes=writes, overwrites=overwrites) as (view,):
            yield view, tier

    @contextlib.contextmanager
    def access(self, writes: bool):
        with self.placed(writes) as (view, _):
            yield view

    @contextlib.contextmanager
    def placed_on(self, tier: Location, writes: bool):
        with self.manager.accessed(self.handle, tier, writes=writes) as (view,):
            yield view

    def location(self) -> Location:
        return self.manager.chunk(self.handle).location

    def forget(self) -> None:
        if self.manager.chunk(self.handle).state is not TensorState.FREE:
            self.manager.free(self.handle)  # already FREE: it has held nothing since

    def on_device(self, full: torch.Tensor, rank: int, count: int) -> torch.Tensor:
        into = shard_of(full, rank, count)
        # read-only (an NVMe copy stays current) and released at once: nothing stays pinned in the manager
        with self.placed(writes=False) as (view, tier):
            self.manager.memory.copy(into, Location.DEVICE, view, tier)
        return into

    def write_home(self, values: torch.Tensor) -> None:
        with self.placed_on(Location.CPU, writes=True) as home:
            self.manager.memory.down_into(home, values)

    def settle_home(self) -> None:
        """The values go to their home tier now (a write to NVMe once), so that later page-outs of these read-only
        values are drops (Note [frozen chunks])."""
        if self.home is Location.NVME and self.location() is not Location.NVME:
            self.manager.move(self.handle, Location.NVME)

    def accumulate(self, values: torch.Tensor, first: bool) -> None:
        # first: every element is written, so a shard holding nothing needs no zero-fill
        memory = self.manager.memory
        with self.placed(writes=True, overwrites=first) as (held, tier):
            if first and tier is Location.CPU and memory.separate:
                # straight into the held buffer (pinned on CUDA), non-blocking (Note [staged copies]); the next
                # access, move or free of the shard waits for it
                self.manager.pending_write(self.handle, memory.down_async(held, values, self.manager.pins_host))
            elif first:
                memory.copy(held, tier, values, Location.DEVICE)
            elif tier is Location.CPU and memory.separate:
                self.manager.staging.add_down(held, values)  # in its own dtype, through pinned tiles
            else:
                held.add_(values)


def manage(store: ShardStore, manager: ChunkManager, kind: str, home: Location) -> ManagedStore:
    """`store`'s tensor handed to `manager` (Note [shard stores]): the store that now holds its values."""
    return ManagedStore(store.tensor, manager, kind, home)
