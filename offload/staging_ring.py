"""The host step's copies across the bus: non-blocking, through a ring of pinned host tiles.

Note [staged copies]
The host step (Note [the host step in tiles]) sends every updated tile up: the 16-bit parameter rounded from its
fp32 master, or fp32 values of the device stepped on the host, which came down tile by tile first. A blocking
copy from pageable memory holds the host thread until the device has the tile (CUDA stages it through a bounce
buffer of its own), so the next tile's update waits for the bus. Here each tile goes through one of `SLOTS`
pinned host tiles: the host writes slot k, the copy up is issued non-blocking on the compute stream (where the
parameters are read next, so nothing else needs ordering) and an event marks its end; the host waits for that
event only when the ring comes back to slot k, having updated the tiles between meanwhile. A tile brought down
goes into its slot non-blocking, and the host waits for it before reading it. A reduced gradient shard goes down
the same way as backward retires it (`DeviceMemory.down_async`, straight into its chunk's pinned host buffer): the
copy is the chunk's transfer in flight (`ChunkManager.pending_write`), so the step's access of the shard, or a
move or free of it, waits for it, and the host goes on with backward meanwhile; a micro-batch's shard added to
what is held on the host (not at the boundary) comes down a slot at a time. On the seam (Note [separate device
memory]) the device is host memory: a converted tile is written into the device tensor directly, the copy up
standing for a DMA, which takes no host core. Every copy is recorded in `DeviceMemory.requests` by direction,
whether its host memory is pinned (or asked to be, where nothing can be: a CPU-only torch) and whether it was
issued non-blocking: the recording seam tests read. Where the copies cannot overlap: fp32 values of the device
wait for their copy down before they are stepped (the tile after is not brought down ahead); and with
`step_in_backward` each shard is stepped as it goes down, so the step waits for that copy.
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

    def _next_slot(self, dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, int]:
        """The next slot of `dtype`, its last copy finished."""
        if numel > self.tile:
            raise ValueError(f"a tile of {numel} elements is larger than the ring's {self.tile}")
        slots = self._slots.get(dtype)
        if slots is None:
            slots = self._slots[dtype] = [torch.empty(self.tile, dtype=dtype, pin_memory=self._cuda)
                                          for _ in range(SLOTS)]
        k = self._turn.get(dtype, 0)
        self._turn[dtype] = (k + 1) % SLOTS
        event = self._in_flight.pop((dtype, k), None)
        if event is not None:
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

    def bring_down(self, device_tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A host copy of the flat `device_tensor` in a slot of its dtype, there on return; the slot's key, for
        `send_slot_up`."""
        self.memory.count(DEVICE_TO_HOST, device_tensor.numel() * device_tensor.element_size(), pinned=True,
                          non_blocking=True)
        slot, k = self._next_slot(device_tensor.dtype, device_tensor.numel())
        slot.copy_(device_tensor, non_blocking=self._cuda)
        if self._cuda:
            torch.cuda.current_stream(self.memory.device).synchronize()
        return slot, k

    def add_down(self, host: torch.Tensor, device_tensor: torch.Tensor) -> None:
        """host += device_tensor (same shape), brought down a slot at a time: no host tensor of its size is made."""
        flat, into = device_tensor.reshape(-1), host.view(-1)
        for start in range(0, flat.numel(), self.tile):
            n = min(self.tile, flat.numel() - start)
            slot, _ = self.bring_down(flat.narrow(0, start, n))
            into.narrow(0, start, n).add_(slot)

    def send_slot_up(self, device_tensor: torch.Tensor, slot: torch.Tensor, k: int) -> None:
        """device_tensor := the slot `bring_down` filled (and the host updated), non-blocking."""
        self.memory.count(HOST_TO_DEVICE, device_tensor.numel() * device_tensor.element_size(), pinned=True,
                          non_blocking=True)
        device_tensor.copy_(slot, non_blocking=self._cuda)
        self._issued(slot.dtype, k)
