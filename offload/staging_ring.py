"""The host step's copies across the bus: non-blocking, through a ring of pinned host tiles.

Note [staged copies]
The host step (Note [the host step in tiles]) sends every updated tile up: the 16-bit parameter rounded from its
fp32 master, or fp32 values of the device stepped on the host, which came down tile by tile first. A blocking copy
from pageable memory holds the host thread until the device has the tile (CUDA stages it through a bounce buffer of
its own), so the next tile's update waits for the bus. Here each tile goes through one of `SLOTS` pinned host tiles:
the host writes slot k, the copy up is issued non-blocking on the compute stream (where the parameters are read
next, so nothing else needs ordering) and an event marks its end; the host waits for that event only when the ring
comes back to slot k, having updated the tiles between meanwhile (a tensor another optimizer stepped whole on the
host goes up the same way, a slot at a time). A tile brought down goes into its slot non-blocking, issued one tile
ahead (while the host updates the tile before it; on one stream it follows that slot's last copy up, so the host
does not wait to reuse the slot), and the host waits for it only before reading it. A reduced gradient shard goes
down the same way as backward retires it (`DeviceMemory.down_async`, straight into its chunk's pinned host buffer):
the copy is the chunk's transfer in flight (`ChunkManager.pending_write`), so the step's access of the shard, or a
move or free of it, waits for it, and the host goes on with backward meanwhile; a micro-batch's shard added to what
is held on the host (not at the boundary) comes down a slot at a time. On the seam (Note [separate device memory])
the device is host memory: a converted tile is written into the device tensor directly, the copy up standing for a
DMA, which takes no host core. Every copy is recorded in `DeviceMemory.requests` by direction, whether its host
memory is pinned (or asked to be, where nothing can be: a CPU-only torch) and whether it was issued non-blocking:
the recording seam tests read. Where the copies cannot overlap: the first tile brought down is waited for at once;
fp32 values of the device that an optimizer other than torch's fused Adam steps come down whole
(`DeviceMemory.down`); and with `step_in_backward` each shard is stepped as it goes down, so the step waits for that
copy.
"""

from __future__ import annotations

import torch

from offload.device_memory import DEVICE_TO_HOST, HOST_TO_DEVICE, DeviceMemory

SLOTS = 2  # pinned tiles per dtype: the host writes one while the other is on the bus
STAGING_TILE = 1 << 20  # elements per slot where the caller does not choose


class StagingRing:
    """Pinned host tiles of `tile` elements per dtype, reused in turn (Note [staged copies])."""

    def __init__(self, memory: DeviceMemory, tile: int = STAGING_TILE):
        self.memory, self.tile = memory, tile
        self._cuda = memory.device.type == "cuda"
        self._slots: dict[torch.dtype, list[torch.Tensor]] = {}
        self._in_flight: dict[tuple[torch.dtype, int], torch.cuda.Event] = {}
        self._turn: dict[torch.dtype, int] = {}

    def _next_slot(self, dtype: torch.dtype, numel: int, host_writes: bool = True) -> tuple[torch.Tensor, int]:
        """The next slot of `dtype`, its last copy finished where the host writes it (a copy into it on the stream
        follows that copy there)."""
        if numel > self.tile:
            raise ValueError(f"a tile of {numel} elements is larger than the ring's {self.tile}")
        slots = self._slots.get(dtype)
        if slots is None:
            slots = self._slots[dtype] = [torch.empty(self.tile, dtype=dtype, pin_memory=self._cuda)
                                          for _ in range(SLOTS)]
        k = self._turn.get(dtype, 0)
        self._turn[dtype] = (k + 1) % SLOTS
        event = self._in_flight.pop((dtype, k), None)
        if event is not None and host_writes:
            event.synchronize()
        return slots[k][:numel], k

    def _issued(self, dtype: torch.dtype, k: int) -> None:
        if self._cuda:
            self._in_flight[(dtype, k)] = torch.cuda.current_stream(self.memory.device).record_event()

    def send_up(self, device_tensor: torch.Tensor, values: torch.Tensor) -> None:
        """device_tensor := host `values`, converted on the host to its dtype (only its bytes cross the bus)."""
        self.memory.count(HOST_TO_DEVICE, device_tensor.numel() * device_tensor.element_size(), pinned=True,
                          non_blocking=True)
        if self.memory.device.type == "cpu":  # the seam: the device is host memory (the copy stands for a DMA)
            device_tensor.copy_(values)
            return
        slot, k = self._next_slot(device_tensor.dtype, values.numel())
        slot.copy_(values.view(-1))
        device_tensor.view(-1).copy_(slot, non_blocking=self._cuda)
        self._issued(device_tensor.dtype, k)

    def send_all_up(self, device_tensor: torch.Tensor, values: torch.Tensor) -> None:
        """send_up of a whole tensor (any size; `values` of the same shape), a slot at a time."""
        flat, source = device_tensor.view(-1), values.reshape(-1)
        for start in range(0, flat.numel(), self.tile):
            n = min(self.tile, flat.numel() - start)
            self.send_up(flat.narrow(0, start, n), source.narrow(0, start, n))

    def bring_down_ahead(self, device_tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Issues the copy of the flat `device_tensor` into the next slot of its dtype, non-blocking; returns the slot
        and its key. The host reads the slot only after `landed(slot, key)`."""
        self.memory.count(DEVICE_TO_HOST, device_tensor.numel() * device_tensor.element_size(), pinned=True,
                          non_blocking=True)
        slot, k = self._next_slot(device_tensor.dtype, device_tensor.numel(), host_writes=False)
        slot.copy_(device_tensor, non_blocking=self._cuda)
        self._issued(device_tensor.dtype, k)
        return slot, k

    def landed(self, slot: torch.Tensor, k: int) -> None:
        """Waits for the copy `bring_down_ahead` issued into slot `k`."""
        event = self._in_flight.pop((slot.dtype, k), None)
        if event is not None:
            event.synchronize()

    def tiles_down(self, device_tensor: torch.Tensor, tile: int):
        """(start, host slot, key) for each tile of `tile` elements of the flat `device_tensor`, each brought down
        into a slot while the caller works on the tile before it; the caller is done with a slot (or has sent it
        up: `send_slot_up`) when it asks for the next."""
        flat = device_tensor.view(-1)
        starts = range(0, flat.numel(), tile)
        ahead = None
        for i, start in enumerate(starts):
            if ahead is None:
                ahead = self.bring_down_ahead(flat.narrow(0, start, min(tile, flat.numel() - start)))
            slot, k = ahead
            ahead = None
            if i + 1 < len(starts):
                nxt = starts[i + 1]
                ahead = self.bring_down_ahead(flat.narrow(0, nxt, min(tile, flat.numel() - nxt)))
            self.landed(slot, k)
            yield start, slot, k

    def add_down(self, host: torch.Tensor, device_tensor: torch.Tensor) -> None:
        """host += device_tensor (same shape), brought down a slot at a time: no host tensor of its size is made."""
        into = host.view(-1)
        for start, slot, _ in self.tiles_down(device_tensor.reshape(-1), self.tile):
            into.narrow(0, start, slot.numel()).add_(slot)

    def send_slot_up(self, device_tensor: torch.Tensor, slot: torch.Tensor, k: int) -> None:
        """device_tensor := the slot `bring_down` filled (and the host updated), non-blocking."""
        self.memory.count(HOST_TO_DEVICE, device_tensor.numel() * device_tensor.element_size(), pinned=True,
                          non_blocking=True)
        device_tensor.copy_(slot, non_blocking=self._cuda)
        self._issued(slot.dtype, k)
