"""Chunks: flat buffers of one dtype holding many tensors as views.

Note [chunk packing]
Tensors are packed into chunks in the order they are registered (the order the model uses
them), each at the next free offset of the current chunk. A tensor that does not fit in what
is left of the current chunk opens a new chunk; a tensor larger than the capacity gets a chunk
of its own, sized to it. The first chunk may be given a smaller capacity of its own (see
`first_capacity`; the engine uses it for the chunk whose reduction cannot overlap backward).
Every chunk is then trimmed to what it holds (rounded up to `align`): the capacity bounds a
chunk, it is not its size. The room a tensor did not fit into would otherwise be padding on every
tier and on the bus: 31% of a GPT whose 4M-element MLP weights nearly fill a chunk each
(scripts/gpu_check.py on an H200 measured 5.23 bus bytes per parameter where 4 move data).
Padding (the rounding to `align`) is zero-filled and never aliased by a tensor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch

from offload.states import TensorState, check_transition, chunk_state

DEFAULT_CHUNK_CAPACITY = 1 << 22  # elements: 16 MiB of fp32, large enough for full-speed NVMe and collectives


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives: chunk index, element offset inside it, and its shape."""

    chunk: int
    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()


def plan_slots(shapes: Sequence[torch.Size], capacity: int, align: int = 1,
               first_capacity: int | None = None) -> tuple[list[Slot], list[int]]:
    """Packs shapes into chunks (Note [chunk packing]); returns each tensor's slot and each chunk's size."""
    if capacity < 1 or (first_capacity is not None and first_capacity < 1):
        raise ValueError(f"chunk capacity must be >= 1 element, got {capacity} (first chunk: {first_capacity})")
    if align < 1:
        raise ValueError(f"chunk alignment must be >= 1 element, got {align}")
    slots: list[Slot] = []
    sizes: list[int] = []  # each chunk's elements used, trimmed at the end
    used = limit = 0  # elements used in the open chunk, and its capacity (0: no chunk open)
    for shape in shapes:
        shape = torch.Size(shape)
        numel = shape.numel()
        if not limit or used + numel > limit:  # open a new chunk (none is open after an oversized one)
            limit = first_capacity if not sizes and first_capacity is not None else capacity
            if numel > limit:  # oversized: a chunk of its own
                sizes.append(numel)
                slots.append(Slot(len(sizes) - 1, 0, shape))
                used = limit = 0
                continue
            sizes.append(0)
            used = 0
        slots.append(Slot(len(sizes) - 1, used, shape))
        used += numel
        sizes[-1] = used
    return slots, [max(_round_up(size, align), 1) for size in sizes]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Location(enum.Enum):
    """Where a chunk's payload is: one of the three tiers, or nowhere (RELEASED: no payload)."""

    DEVICE = "device"
    CPU = "cpu"
    NVME = "nvme"
    RELEASED = "released"

    @property
    def below(self) -> Location | None:
        """The tier a chunk evicted from here goes to (None: the bottom, or no tier)."""
        return {Location.DEVICE: Location.CPU, Location.CPU: Location.NVME}.get(self)


class Chunk:
    """One flat payload; tensors are views into it at their slots, each with a state (Note [chunk states]).

    `payload` is None while the chunk is on NVMe or released; `location` says which (a ChunkList's
    chunks are always on the DEVICE tier; a ChunkManager moves its chunks and keeps `location` true).
    """

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device | str | None = None,
                 location: Location = Location.DEVICE, zeroed: bool = True, released: bool = False):
        """zeroed=False: an uninitialized payload (torch.empty: its memory is not touched until written);
        released=True: uninitialized, for its owner to free (resize the storage to 0) as soon as the views into it
        are cut (views cannot be cut from a storage of size 0), so that chunks made one after another never hold
        more than one payload (ChunkList does so)."""
        self.numel, self.dtype = size, dtype
        make = torch.zeros if zeroed and not released else torch.empty
        self.payload: torch.Tensor | None = None if device is None else make(size, dtype=dtype, device=device)
        self.location = location if device is not None else Location.RELEASED
        self.slots: list[Slot] = []
        self.states: list[TensorState] = []
        self._computing = 0  # tensors in COMPUTE: `pinned` is asked on every eviction, so it is kept, not derived

    def add(self, slot: Slot, state: TensorState = TensorState.HOLD) -> None:
        self.slots.append(slot)
        self.states.append(state)
        self._computing += state is TensorState.COMPUTE

    def set_state(self, index: int, new: TensorState) -> None:
        """Tensor `index` of this chunk (in registration order) changes state; illegal changes raise."""
        old = self.states[index]
        self.states[index] = check_transition(old, new, lambda: f"tensor {index} of a chunk")
        self._computing += (new is TensorState.COMPUTE) - (old is TensorState.COMPUTE)

    @property
    def state(self) -> TensorState:
        return chunk_state(self.states)

    @property
    def pinned(self) -> bool:
        """A chunk with a tensor in COMPUTE must not be moved or evicted."""
        return self._computing > 0

    @property
    def size(self) -> int:
        return self.numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def used(self) -> int:
        return sum(s.numel for s in self.slots)

    def view(self, slot: Slot) -> torch.Tensor:
        if self.payload is None:
            raise RuntimeError(f"chunk has no payload (it is {self.location.value}); make it resident first")
        return self.payload.narrow(0, slot.offset, slot.numel).view(slot.shape)

    def views(self) -> list[torch.Tensor]:
        return [self.view(s) for s in self.slots]


class ChunkList:
    """All chunks of one kind and dtype, built from a list of tensors in registration order.

    The tensors' values are copied in (meta tensors have none: their views are left as allocated);
    `views[i]` is tensor i's view into its chunk; the payloads start zeroed, or with released=True each payload's
    storage is freed as soon as it is made (nothing is copied: see Chunk).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        capacity: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        align: int = 1,
        copy_values: bool = True,
        first_capacity: int | None = None,
        released: bool = False,
    ):
        if not tensors:
            raise ValueError("a ChunkList needs at least one tensor")
        dtype = dtype or tensors[0].dtype
        device = device or tensors[0].device
        slots, sizes = plan_slots([t.shape for t in tensors], capacity, align, first_capacity)
        self.dtype = dtype
        copy_values = copy_values and not released
        self.chunks: list[Chunk] = []
        self.slots = slots
        self.views: list[torch.Tensor] = []
        for tensor, slot in zip(tensors, slots):
            while slot.chunk >= len(self.chunks):  # made one by one: a released one holds no memory past its views
                if released and self.chunks:
                    self.chunks[-1].payload.untyped_storage().resize_(0)
                self.chunks.append(Chunk(sizes[len(self.chunks)], dtype, device, released=released))
            chunk = self.chunks[slot.chunk]
            chunk.add(slot)
            view = chunk.view(slot)
            if copy_values and not tensor.is_meta:  # meta: values come later (engine's zero_init)
                view.copy_(tensor.detach())
            self.views.append(view)
        if released:
            self.chunks[-1].payload.untyped_storage().resize_(0)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def numel(self) -> int:
        return sum(c.size for c in self.chunks)
