"""Bookkeeping of a ChunkManager: where each chunk is, what each tier holds, which transfers are in flight.

Every change of a chunk's location or payload, every buffer allocated or given back and every
transfer started or finished goes through `Residency`, so the per-tier byte counts, the
per-location sets and the in-flight set can never disagree with the chunks themselves.
"""

from __future__ import annotations

import torch

from offload.chunk import Chunk, Location
from offload.copy_engine import CopyDone
from offload.host_pool import HostBufferPool, pinned_block_size
from offload.nvme import SwapHandle
from offload.units import fmt_bytes


class Transfer:
    """The one transfer in flight for a chunk: how to wait for it, what to free or undo after it."""

    def __init__(self, waiter: SwapHandle | CopyDone, frees: tuple[Location, torch.Tensor] | None, undo):
        self.waiter, self.frees, self.undo = waiter, frees, undo

    def done(self) -> bool:
        return self.waiter.done()

    def wait(self) -> None:
        """Blocks until finished; re-raises the transfer's error."""
        self.waiter.wait() if isinstance(self.waiter, SwapHandle) else self.waiter.wait_host()


class ChunkEntry:
    """A chunk as the manager sees it: its kind, swap key, transfer in flight and prefetch mark."""

    def __init__(self, chunk: Chunk, kind: str, cid: int, home: Location = Location.CPU):
        self.chunk, self.kind, self.id = chunk, kind, cid
        self.home = home  # the tier it was registered on
        self.key = f"{kind}.{cid}"
        self.transfer: Transfer | None = None
        self.prefetched = False  # brought by a prefetch and not yet accessed
        self.on_disk = False  # a swap file of it exists
        self.disk_current = False  # ... and holds exactly its current bytes (Note [clean chunks])

    def describe(self) -> str:
        return f"{self.id} ({self.kind}, {fmt_bytes(self.held)})"

    @property
    def held(self) -> int:
        """Bytes its payload buffer holds (with padding), or its payload size when it has none."""
        return held_bytes(self.chunk.payload) if self.chunk.payload is not None else self.chunk.nbytes


class Residency:
    """Chunks by location, bytes held per tier, transfers in flight; buffers are allocated here."""

    def __init__(self, device: torch.device, pool: HostBufferPool):
        self.device, self.pool = device, pool
        self.entries: list[ChunkEntry] = []
        self._at: dict[Location, dict[int, ChunkEntry]] = {loc: {} for loc in Location}
        self.in_flight: dict[int, ChunkEntry] = {}
        self._charged = {Location.DEVICE: 0, Location.CPU: 0}

    def add(self, chunk: Chunk, kind: str, home: Location = Location.CPU) -> ChunkEntry:
        entry = ChunkEntry(chunk, kind, len(self.entries), home)
        self.entries.append(entry)
        self._at[chunk.location][entry.id] = entry
        return entry

    def forget(self, entry: ChunkEntry) -> None:
        """Removes the newest chunk (a registration rolled back); it must hold nothing."""
        assert entry is self.entries[-1] and entry.chunk.payload is None and entry.transfer is None
        self.entries.pop()
        del self._at[entry.chunk.location][entry.id]

    def at(self, location: Location) -> list[ChunkEntry]:
        return list(self._at[location].values())

    def place(self, entry: ChunkEntry, location: Location, payload: torch.Tensor | None) -> None:
        del self._at[entry.chunk.location][entry.id]
        entry.chunk.location, entry.chunk.payload = location, payload
        self._at[location][entry.id] = entry

    def set_transfer(self, entry: ChunkEntry, transfer: Transfer | None) -> None:
        entry.transfer = transfer
        if transfer is None:
            self.in_flight.pop(entry.id, None)
        else:
            self.in_flight[entry.id] = entry

    def used(self, location: Location) -> int:
        """Bytes held on a tier: payloads, buffers of transfers in flight, kept free host buffers."""
        if location is Location.NVME:
            return sum(e.chunk.nbytes for e in self._at[Location.NVME].values())
        return self._charged[location] + (self.pool.free_bytes if location is Location.CPU else 0)

    def used_by_kind(self, location: Location) -> dict[str, int]:
        """Bytes of chunk payloads on a tier, by kind."""
        out: dict[str, int] = {}
        for entry in self._at[location].values():
            out[entry.kind] = out.get(entry.kind, 0) + entry.held
        return out

    def footprint(self, location: Location, chunk: Chunk) -> int:
        """The bytes `allocate` will hold for this chunk on a tier."""
        return self.pool.footprint(chunk.numel, chunk.dtype) if location is Location.CPU else chunk.nbytes

    def demand(self, location: Location, chunk: Chunk | None) -> tuple[tuple | None, int]:
        """What a new buffer for `chunk` (None: no buffer) asks of a tier: (the key of the kept host buffer
        `allocate` would reuse, or None; the bytes it adds to the tier). A reused kept buffer adds none."""
        if chunk is None:
            return None, 0
        if location is Location.CPU and self.pool.has(chunk.numel, chunk.dtype):
            return (chunk.numel, chunk.dtype), 0  # acquire() moves it from kept to charged
        return None, self.footprint(location, chunk)

    def allocate(self, location: Location, chunk: Chunk) -> torch.Tensor:
        """A buffer for the chunk's payload on a tier (contents undefined). Its whole allocation counts from now
        (with any padding for O_DIRECT: Note [host buffer pool]); a failed allocation counts nothing."""
        if location is Location.CPU:
            buf = self.pool.acquire(chunk.numel, chunk.dtype)
        else:
            buf = torch.empty(chunk.numel, dtype=chunk.dtype, device=self.device)
        self._charged[location] += held_bytes(buf)
        return buf

    def give_back(self, location: Location, buf: torch.Tensor) -> None:
        self._charged[location] -= held_bytes(buf)
        if location is Location.CPU:
            self.pool.release(buf)


def held_bytes(buf: torch.Tensor) -> int:
    """The memory a payload buffer really holds: its whole storage (a padded buffer holds more than its numel);
    pinned storage as torch's host allocator rounds it (a power of two: Note [host buffer pool])."""
    nbytes = buf.untyped_storage().nbytes()
    return pinned_block_size(nbytes) if buf.device.type == "cpu" and buf.is_pinned() else nbytes


def budget_message(chunks: Residency, location: Location, nbytes: int, budget: float, protect: set[int], *,
                   evictable: bool, note: str = "", key: str | None = None) -> str:
    """Why a tier cannot take `nbytes` more: its budget, the demand, and what holds it (pinned, moving); `key`:
    the setting that sets this budget, named with the value it needs (the pinned chunks and the demand)."""
    here = chunks.at(location)
    pinned = [e for e in here if e.chunk.pinned]
    moving = [e for e in here if e.transfer is not None or e.id in protect]
    what = f"{fmt_bytes(nbytes)} more on the {location.value} tier" + (f" ({note})" if note else "")
    if nbytes > budget:
        fix = f"set {key} to at least {fmt_bytes(nbytes)}" if key else "raise that budget"
        return (f"cannot place {what}: a chunk of {fmt_bytes(nbytes)} is larger than the whole {location.value} "
                f"budget of {fmt_bytes(budget)}; {fix} or register with a smaller chunk capacity")
    lines = [f"cannot place {what}: its budget is {fmt_bytes(budget)} and {fmt_bytes(chunks.used(location))} "
             f"are in use", f"pinned in COMPUTE: {_listing(pinned)}", f"being moved: {_listing(moving)}"]
    if not evictable:
        lines.append(f"chunks on the {location.value} tier cannot be evicted: no NVMe tier was given")
    if key:
        needed = sum(e.held for e in pinned) + nbytes
        lines.append(f"the chunks this step uses together need {fmt_bytes(needed)}: set {key} to at least that")
    else:
        lines.append(f"raise the {location.value} budget, release chunks that are done (release()), "
                     f"or give a lower tier room")
    return "; ".join(lines)


def _listing(entries: list[ChunkEntry]) -> str:
    if not entries:
        return "none"
    return ", ".join(e.describe() for e in entries) + f" = {fmt_bytes(sum(e.held for e in entries))}"
