"""ChunkManager: chunks of registered tensors, moved between device, CPU and NVMe under byte budgets.

Note [chunk manager]
`register(kind, tensors)` packs tensors into new chunks (Note [chunk packing]) placed on a tier.
`access(chunk, location)` makes the chunk resident there, marks its tensors COMPUTE (pinned: never
moved or evicted) and returns their views; `release(chunk, state)` ends the use (HOLD, or one of
the HOLD_AFTER_* states; FREE drops the payload). `move` puts a chunk on another tier; `free`
drops it. Views are valid until the chunk next moves: take them from `access` each time.

Budgets: each of the device and CPU tiers has a byte budget (None: unbounded) covering
everything the manager holds there: chunk payload buffers (whole allocations, padding
included), the source buffers of transfers still in flight (a chunk being moved is charged to
both tiers until its copy completes) and free host buffers kept for reuse (Note [host buffer
pool]). Before a buffer is allocated on a tier, room is made: finished transfers are settled,
kept buffers trimmed, then chunks that are not in COMPUTE are evicted one tier down (device →
CPU → NVMe; the policy picks which: Note [eviction order]), waiting for transfers in flight if
that is what frees the room. If nothing can free enough, `BudgetError` names the budget, the
demand and what holds the tier.

Transfers (offload/transfers.py): CPU↔NVMe through the NvmeStore's worker threads, device↔CPU
through the copy engine (Note [side-stream copies]); a chunk has at most one transfer in flight,
and `access` waits for it (counted as a blocking wait). Warm-up, trace-following and prefetch:
Note [trace and divergence]; a prefetch never evicts a chunk needed sooner, never waits for the
disk and never raises. A failed transfer is rolled back: the chunk is where it was before, with
its data (a swap-out that hit a full disk leaves it on the CPU). Its error is raised to the
caller that waited for that transfer; one found finished in the background is counted
(`failed_transfers`) and its error meets whoever needs that chunk or that room next.

Note [clean chunks]
A chunk read back from NVMe and only read since (every `access` said writes=False) still
matches its swap file: evicting it to NVMe drops the payload instead of writing it again, which
halves the disk traffic of parameters that forward and backward only read. `disk_current`
records that: set when a swap-out is issued (a chunk read back from its file keeps it), cleared by
an access that may write and by a failed swap-out. Registration and materialization leave it False.

Note [prefetch retry]
A prefetch whose room is still being written (an eviction's swap-out in flight) stops the scan rather than
wait. In a pass over states on NVMe each chunk is read, updated and written back, so with a window of a few
chunks the room for the next read is nearly always such a write, and if the scan waited for the next access the
read would start only when it is needed. So the position where the scan stopped is kept, and a `release` that
settles a finished transfer goes on scanning from there: the read starts as soon as its room is free.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch

from offload.chunk import DEFAULT_CHUNK_CAPACITY, Chunk, Location, plan_slots
from offload.copy_engine import CopyDone, CopyEngine
from offload.device_memory import DeviceMemory
from offload.device_tier import DeviceTier, MeasuredPlacement
from offload.errors import OffloadError
from offload.host_pool import HostBufferPool, pinning
from offload.nvme import NvmeSettings
from offload.policy import PlacementPolicy, is_above, next_tier, worth_prefetching
from offload.residency import ChunkEntry, Residency, Transfer, budget_message, held_bytes
from offload.staging_ring import StagingRing
from offload.states import TensorState, check_transition
from offload.stats import ManagerStats
from offload.tracer import TracePhase, Tracer
from offload.transfers import Transfers
from offload.units import fmt_bytes

_TIERS = (Location.DEVICE, Location.CPU, Location.NVME)


class BudgetError(OffloadError):
    """A tier's budget cannot hold what is asked of it, and nothing can be evicted to make room."""


@dataclass(frozen=True)
class Budgets:
    """Byte budgets of the device and CPU tiers (None: unbounded); NVMe is bounded by its disk. keys: the setting
    that sets each tier's budget (e.g. a config key), named in BudgetError."""

    device: int | None = None
    cpu: int | None = None
    keys: dict[Location, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class TensorRef:
    """A registered tensor: its chunk's id and its index among that chunk's tensors."""

    chunk: int
    index: int


class ChunkManager:
    """Chunks of registered tensors on device / CPU / NVMe under byte budgets (Note [chunk manager])."""

    def __init__(self, device: torch.device | str = "cpu", budgets: Budgets = Budgets(), *,
                 nvme: NvmeSettings | None = None, pin_memory: bool | None = None, prefetch_depth: int = 4,
                 keep_free_bytes: int = 1 << 28, measured: MeasuredPlacement | None = None,
                 memory: DeviceMemory | None = None):
        """nvme: the tier below the CPU (None: none, and the CPU budget cannot evict); measured: the device budget
        follows the device's free memory (Note [measured placement]); memory: the compute device's memory (Note
        [separate device memory]; default: as the device says)."""
        self.device = torch.device(device)
        self.memory = memory if memory is not None else DeviceMemory(self.device)
        self.prefetch_depth = prefetch_depth
        self._prefetch_cut_at: int | None = None  # where the last prefetch scan found no room (Note [prefetch retry])
        for name, value in (("device", budgets.device), ("cpu", budgets.cpu)):
            if value is not None and value < 0:
                raise ValueError(f"the {name} budget must be >= 0 bytes or None (unbounded), got {value}")
        # whether host buffers are asked to be pinned: as configured, else where the device has memory of its own
        # (the seam too; Note [staged copies] records it); `pinning` says what this machine can give
        self.pins_host = self.memory.separate if pin_memory is None else pin_memory
        self.staging = StagingRing(self.memory)  # pinned tiles for what crosses the bus beside the chunks
        pinned = pinning(self.device.type == "cuda" if pin_memory is None else pin_memory)
        self.store = nvme.store() if nvme is not None else None
        self.pool = HostBufferPool(pinned=pinned, block_size=self.store.block_size if self.store else 1 << 20,
                                   keep_bytes=keep_free_bytes)
        # the callbacks below reach the manager weakly: a cycle would keep a dropped manager until gc runs
        manager = weakref.ref(self)
        self.tracer = Tracer(lambda: manager().device_tier.non_chunk_bytes())
        self._chunks = Residency(self.device, self.pool)
        self._kinds: dict[str, list[int]] = {}
        self._stats = ManagerStats()
        self._policy = PlacementPolicy(self.tracer)  # decides what to evict and what to prefetch
        self._transfers = Transfers(self._chunks, CopyEngine(self.device), self.store, self._stats)
        self.device_tier = DeviceTier(self.memory, self._chunks, self.tracer, self._policy,
                                      lambda entry, protect: manager()._evict(entry, protect, None), budgets.device,
                                      *((measured.capacity, measured.margin) if measured is not None else ()))
        self._budgets = budgets
        self._closed = False

    # ---- registration

    def register(self, kind: str, tensors: Sequence[torch.Tensor], *, location: Location = Location.CPU,
                 capacity: int | None = None, dtype: torch.dtype | None = None,
                 zeros: bool = False) -> list[TensorRef]:
        """Copies `tensors` (in use order) into new chunks of `kind` on `location`; returns where each went.

        `capacity` (elements, the most a chunk holds: Note [chunk packing]) defaults to DEFAULT_CHUNK_CAPACITY.
        zeros=True: only the tensors' shapes count; the chunks start FREE (zeros, as after `free`: no payload
        and no swap file until a first access), so registering states that start at zero costs no memory or I/O.
        """
        self._check_open()
        if not tensors:
            raise ValueError(f"register({kind!r}) needs at least one tensor")
        if location is Location.RELEASED:
            raise ValueError("register onto a tier (DEVICE, CPU or NVME); RELEASED chunks hold nothing")
        if location is Location.NVME and self.store is None:
            raise OffloadError(f"cannot register {kind!r} onto NVMe: no nvme_dir was given to the ChunkManager "
                               "(nvme=NvmeSettings(nvme_dir))")
        dtype = dtype or tensors[0].dtype
        shapes = [t.shape for t in tensors]
        slots, sizes = plan_slots(shapes, capacity or DEFAULT_CHUNK_CAPACITY)
        entries = [self._chunks.add(Chunk(size, dtype), kind, location) for size in sizes]
        first = entries[0].id
        refs = []
        members: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for tensor, slot in zip(tensors, slots):
            chunk = entries[slot.chunk].chunk
            refs.append(TensorRef(first + slot.chunk, len(chunk.slots)))
            members.setdefault(first + slot.chunk, []).append((len(chunk.slots), tensor))
            chunk.add(slot, TensorState.FREE if zeros else TensorState.HOLD)
        if zeros:
            self._kinds.setdefault(kind, []).extend(e.id for e in entries)
            return refs
        try:
            for entry in entries:
                self._materialize(entry, Location.CPU if location is Location.NVME else location, {entry.id})
                views = entry.chunk.views()
                for index, tensor in members[entry.id]:
                    views[index].copy_(tensor.detach())
                if location is Location.NVME:
                    self._move(entry, Location.NVME, protect={entry.id})
                    self._transfers.settle(entry, block=True)
        except BaseException:
            for entry in reversed(entries):  # nothing half-registered: the new chunks go away
                self._drop(entry)
                self._chunks.forget(entry)
            raise
        self._kinds.setdefault(kind, []).extend(e.id for e in entries)
        return refs

    # ---- use

    def access(self, chunk: int, location: Location = Location.DEVICE,
               tensors: Sequence[int] | None = None, *, writes: bool = True,
               overwrites: bool = False) -> list[torch.Tensor]:
        """Makes the chunk resident on `location`, marks `tensors` (default all) COMPUTE, returns all views.

        writes=False promises the caller will not modify the chunk during this use: a chunk whose swap
        file is then still current is evicted to NVMe by dropping its payload, with no write (Note
        [clean chunks]). Modifying it anyway loses the change at its next eviction. overwrites=True promises the
        caller writes every element before it reads any: a chunk holding nothing (FREE) gets its payload
        uninitialized instead of zeroed.
        """
        self._check_open()
        entry = self._entry(chunk)
        if location not in (Location.DEVICE, Location.CPU):
            raise ValueError(f"access makes a chunk resident for compute: DEVICE or CPU, not {location}")
        if entry.chunk.pinned and entry.chunk.location is not location:
            raise OffloadError(f"chunk {entry.describe()} is in use on the {entry.chunk.location.value} tier (a tensor "
                               f"is in COMPUTE): release it before accessing it on the {location.value} tier")
        phase = self.tracer.on_access(chunk, location)
        self._prefetch_cut_at = None  # a scan from this access's position replaces it
        self.device_tier.on_access()  # Note [measured placement]
        self._policy.used(chunk)
        self._transfers.settle_finished()
        if entry.prefetched:
            self._stats.prefetch_hits += 1
            entry.prefetched = False
        elif entry.chunk.location is not location and entry.chunk.location is not Location.RELEASED:
            self._stats.prefetch_misses += 1
        self._move(entry, location, protect={chunk}, on_demand=True, zeroed=not overwrites)
        self._make_room(location, None, {chunk})  # the budget may have shrunk (device_capacity): shed the excess
        if location is not Location.DEVICE:
            self.device_tier.shed({chunk})
        self._transfers.settle(entry, block=True, count_wait=True, on_compute_stream=location is Location.DEVICE)
        self._set_states(entry, TensorState.COMPUTE, tensors)
        if writes:
            entry.disk_current = False
        if phase is TracePhase.FOLLOWING and self.prefetch_depth > 0:
            self._prefetch_ahead(self.tracer.position - 1)  # best effort: never raises
        return entry.chunk.views()

    def pending_write(self, chunk: int, done: CopyDone) -> None:
        """A copy into the chunk's host buffer, issued on the compute stream and maybe unfinished (Note [staged
        copies]), becomes its transfer in flight: every later access, move or free of the chunk waits for it. A
        chunk that cannot take it (not on the CPU tier, or with a transfer of its own) is refused after the copy
        has finished, so that nothing is left writing into a buffer the manager does not know is in use."""
        self._check_open()
        entry = self._entry(chunk)
        if entry.transfer is not None or entry.chunk.location is not Location.CPU:
            done.wait_host()
            raise OffloadError(f"chunk {entry.describe()} cannot take a copy in flight: it is not on the CPU tier "
                               "with no transfer of its own")
        if done.done():
            return

        def undo() -> None:
            raise AssertionError("a device/host copy cannot fail after it was issued")

        self._chunks.set_transfer(entry, Transfer(done, None, undo))

    def use_tier(self, *chunks: int) -> Location:
        """Where a use of these chunks, held together, makes them resident (Note [where a chunk is used])."""
        return self.device_tier.use_tier([self._entry(c) for c in chunks])

    def used_bytes_by_kind(self, location: Location) -> dict[str, int]:
        """Bytes of chunk payloads on a tier, by kind."""
        return self._chunks.used_by_kind(location)

    @contextlib.contextmanager
    def accessed(self, chunk: int, location: Location = Location.DEVICE, *, writes: bool = True,
                 overwrites: bool = False):
        """`access` for the duration of a block (all its tensors), released (HOLD) after it; yields the views."""
        views = self.access(chunk, location, writes=writes, overwrites=overwrites)
        try:
            yield views
        finally:
            self.release(chunk)

    def release(self, chunk: int, state: TensorState = TensorState.HOLD, tensors: Sequence[int] | None = None) -> None:
        """Ends the use of `tensors` (default all) of a chunk; a chunk whose tensors are all FREE drops its payload."""
        self._check_open()
        entry = self._entry(chunk)
        self._set_states(entry, state, tensors)
        if entry.chunk.state is TensorState.FREE:
            self._drop(entry)
        if self._prefetch_cut_at is not None and self._transfers.settle_finished():
            self._prefetch_ahead(self._prefetch_cut_at)  # room came free since: go on where the scan stopped

    def move(self, chunk: int, location: Location, *, wait: bool = True) -> None:
        """Moves a chunk that is not in COMPUTE to `location` (waits for the transfer unless wait=False)."""
        self._check_open()
        entry = self._entry(chunk)
        if location is Location.RELEASED:
            raise ValueError(f"use free({chunk}) to drop a chunk's payload, not move(..., RELEASED)")
        if entry.chunk.pinned:
            raise OffloadError(f"chunk {entry.describe()} is in use (a tensor is in COMPUTE): "
                               "release it before moving it")
        if location is Location.NVME and self.store is None:
            raise OffloadError(f"cannot move chunk {entry.describe()} to NVMe: "
                               "no nvme_dir was given to the ChunkManager (nvme=NvmeSettings(nvme_dir))")
        self._transfers.settle_finished()
        self._move(entry, location, protect={chunk})
        if wait:
            self._transfers.settle(entry, block=True)

    def prefetch(self, chunk: int, location: Location = Location.DEVICE) -> bool:
        """Starts bringing a chunk toward `location` without evicting anything in use or waiting for the disk;
        False if that is not possible now (no room, or the chunk is in COMPUTE elsewhere)."""
        self._check_open()
        entry = self._entry(chunk)
        if entry.chunk.pinned:
            return entry.chunk.location is location
        self._transfers.settle_finished()
        try:
            return self._start_prefetch(entry, location, float("-inf"))
        except OffloadError:
            return False  # e.g. the eviction it needed hit a full disk: rolled back, a demand access will say so

    def free(self, chunk: int) -> None:
        """Marks every tensor of a chunk FREE and drops its payload (and swap file)."""
        self.release(chunk, TensorState.FREE)

    def end_iteration(self) -> None:
        """Marks the end of a training iteration for the tracer (Note [trace and divergence])."""
        self._prefetch_cut_at = None
        recorded = self.tracer.phase is TracePhase.RECORDING
        self.tracer.end_iteration()
        self.device_tier.end_iteration(recorded)  # Note [measured placement]

    # ---- inspection

    @property
    def copies(self) -> CopyEngine:
        """The device<->host copy engine (Note [side-stream copies]); replaceable, e.g. by tests."""
        return self._transfers.copies

    @copies.setter
    def copies(self, engine: CopyEngine) -> None:
        self._transfers.copies = engine

    @property
    def budgets(self) -> Budgets:
        return self._budgets

    @budgets.setter
    def budgets(self, budgets: Budgets) -> None:
        self._budgets, self.device_tier.cap = budgets, budgets.device

    @property
    def device_capacity(self) -> int | None:
        """The device's memory under placement "auto" (Note [measured placement]); None: no such cap."""
        return self.device_tier.capacity

    @device_capacity.setter
    def device_capacity(self, capacity: int | None) -> None:
        self.device_tier.capacity = capacity

    def chunk(self, chunk: int) -> Chunk:
        return self._entry(chunk).chunk

    def chunks_of(self, kind: str) -> list[int]:
        return list(self._kinds.get(kind, []))

    def used_bytes(self, location: Location) -> int:
        """Bytes the manager holds on a tier (Note [chunk manager]: payloads, buffers in flight, kept buffers)."""
        return self._chunks.used(location)

    @property
    def stats(self) -> ManagerStats:
        s = self._stats
        s.resident_bytes = {loc.value: self.used_bytes(loc) for loc in _TIERS}
        s.trace_divergences = self.tracer.divergences
        if self.store is not None:
            disk = self.store.stats
            s.disk_bytes, s.peak_disk_bytes = disk.disk_bytes, disk.peak_disk_bytes
        if self.tracer.trace is not None:
            s.peak_non_chunk_bytes = self.tracer.trace.peak_non_chunk_bytes
        return copy.deepcopy(s)

    def close(self) -> None:
        """Waits for transfers in flight, frees every payload and removes the swap files."""
        if self._closed:
            return
        for entry in list(self._chunks.in_flight.values()):
            try:
                self._transfers.settle(entry, block=True)
            except OffloadError:
                pass  # closing anyway: the failed transfer was rolled back
        self._closed = True
        if self.store is not None:
            self.store.close()
        for entry in self._chunks.entries:
            if entry.chunk.payload is not None:
                self._chunks.give_back(entry.chunk.location, entry.chunk.payload)
                self._chunks.place(entry, Location.RELEASED, None)
        self.pool.trim()

    def __enter__(self) -> ChunkManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- moves (caller's thread)

    def _move(self, entry: ChunkEntry, target: Location, protect: set[int], on_demand: bool = False,
              only_if_used_after: float | None = None, zeroed: bool = True,
              reserve: dict[Location, int] | None = None) -> bool:
        """Steps the chunk tier by tier toward `target`. A prefetch (only_if_used_after given) issues one
        asynchronous step at most and gives up (False) rather than evict anything needed sooner, or take the room
        `reserve` keeps on a tier for chunks made there sooner (Note [prefetch reach])."""
        prefetch = only_if_used_after is not None
        while entry.chunk.location is not target:
            here = entry.chunk.location
            if here is Location.RELEASED:
                if prefetch:
                    return False  # nothing to bring: access allocates it
                self._materialize(entry, target if target is not Location.NVME else Location.CPU, protect, zeroed)
                continue
            up = is_above(target, here)
            if entry.transfer is not None:
                if prefetch:
                    return True  # already moving; the next look-ahead (or the access) continues it
                if up and here is Location.NVME:
                    self._transfers.reclaim(entry, count_wait=on_demand)
                else:
                    self._transfers.settle(entry, block=True, count_wait=on_demand)
                continue
            step = next_tier(here, target)
            if prefetch and not up:
                return False
            if step is not Location.NVME and not self._make_room(step, entry.chunk, protect, only_if_used_after,
                                                                 (reserve or {}).get(step, 0)):
                return False
            self._transfers.start(entry, step)
            if prefetch:
                return True
        return True

    def _materialize(self, entry: ChunkEntry, location: Location, protect: set[int], zeroed: bool = True) -> None:
        """A RELEASED chunk gets a payload on `location` (its values were FREE; it has no swap file): zeroed, or
        uninitialized for a caller that overwrites it all."""
        self._make_room(location, entry.chunk, protect)
        payload = self._chunks.allocate(location, entry.chunk)
        self._chunks.place(entry, location, payload.zero_() if zeroed else payload)

    def _drop(self, entry: ChunkEntry) -> None:
        """Frees a chunk's payload and swap file; its data is not wanted, so a failed transfer does not matter."""
        if entry.transfer is not None:
            try:
                self._transfers.settle(entry, block=True)
            except OffloadError:
                pass  # rolled back; dropped below all the same
        if entry.chunk.payload is not None:
            self._chunks.give_back(entry.chunk.location, entry.chunk.payload)
        if entry.on_disk:
            self.store.remove(entry.key)
            entry.on_disk = entry.disk_current = False
        self._chunks.place(entry, Location.RELEASED, None)
        entry.prefetched = False

    # ---- budgets

    def _budget(self, location: Location) -> float:
        if location is Location.DEVICE:
            return self.device_tier.budget()
        return float("inf") if self.budgets.cpu is None else self.budgets.cpu

    def _make_room(self, location: Location, chunk: Chunk | None, protect: set[int],
                   only_if_used_after: float | None = None, reserve: int = 0) -> bool:
        """Frees room on a tier for a buffer of `chunk` (None: no new buffer, only the budget must hold) (Note
        [chunk manager]); False (prefetch) or BudgetError if impossible. A kept host buffer the allocation
        will reuse needs no room, and is trimmed last. A prefetch also leaves `reserve` bytes free."""
        budget = self._budget(location) - reserve
        prefetch = only_if_used_after is not None
        spare, nbytes = self._chunks.demand(location, chunk)
        while self.used_bytes(location) + nbytes > budget:
            self._transfers.settle_finished()
            spare, nbytes = self._chunks.demand(location, chunk)  # an eviction may have left a reusable buffer
            excess = self.used_bytes(location) + nbytes - budget
            if excess <= 0:
                break
            if location is Location.CPU and self.pool.trimmable_bytes(spare):
                self.pool.trim(excess, spare)  # keeps one buffer the allocation will reuse
                continue
            leaving = [e for e in self._chunks.in_flight.values()
                       if e.transfer.frees is not None and e.transfer.frees[0] is location]
            if leaving and sum(held_bytes(e.transfer.frees[1]) for e in leaving) >= excess:
                if prefetch:
                    return False  # room is on its way; a prefetch never waits for the disk: next access retries
                self._transfers.settle(leaving[0], block=True)  # wait rather than evict more
                continue
            victim = None
            if nbytes <= budget and self._can_evict(location):
                victim = self._policy.victim(self._chunks.at(location), protect, only_if_used_after)
            if victim is not None:
                if not self._evict(self._chunks.entries[victim], protect, only_if_used_after):
                    return False
                continue
            if prefetch:
                return False
            arriving = [e for e in self._chunks.in_flight.values()
                        if e.chunk.location is location and not e.chunk.pinned and e.id not in protect]
            if (leaving or arriving) and nbytes <= budget:
                self._transfers.settle((leaving or arriving)[0], block=True)  # then it can go, or its room is free
                continue
            note = ""
            if location is Location.DEVICE and self.device_capacity is not None and self.tracer.trace is not None:
                note = (f"its budget now is device_capacity {fmt_bytes(self.device_capacity)} minus the "
                        f"{fmt_bytes(self.device_capacity - budget)} of non-chunk memory the trace recorded here")
            raise BudgetError(budget_message(self._chunks, location, nbytes, budget, protect,
                                             evictable=location is Location.DEVICE or self.store is not None,
                                             note=note, key=self._budgets.keys.get(location)))
        self._stats.peak_bytes[location.value] = max(self._stats.peak_bytes.get(location.value, 0),
                                                     self.used_bytes(location) + nbytes)
        return True

    def _can_evict(self, location: Location) -> bool:
        """Whether a chunk on this tier has a tier below to go to (CPU: only with an NVMe tier)."""
        return location is not Location.CPU or self.store is not None

    def _evict(self, entry: ChunkEntry, protect: set[int], only_if_used_after: float | None) -> bool:
        below = entry.chunk.location.below
        if only_if_used_after is not None and below is not Location.NVME:
            if not self._make_room(below, entry.chunk, protect | {entry.id}, only_if_used_after):
                return False
        self._stats.evictions += 1
        entry.prefetched = False
        self._move(entry, below, protect | {entry.id})
        return True

    # ---- prefetch

    def _prefetch_ahead(self, now: int) -> None:
        """Starts the prefetches the policy asks for after trace position `now`, until one finds no room."""
        self._prefetch_cut_at = None
        for position, chunk, location, reserve in self._policy.to_prefetch(now, self.prefetch_depth, self._chunk_at,
                                                                                  self._budget):
            try:
                if not self._start_prefetch(self._chunks.entries[chunk], location, position, reserve):
                    self._prefetch_cut_at = now
                    break  # no room for this one: later ones are needed even later
            except OffloadError:
                self._stats.failed_transfers += 1  # rolled back; a demand access will meet the error
                break

    def _start_prefetch(self, entry: ChunkEntry, location: Location, position: float,
                        reserve: dict[Location, int] | None = None) -> bool:
        if not worth_prefetching(entry.chunk.location, location):
            return True  # nothing to bring: allocated on access, or already there (or above)
        started = entry.transfer is None
        if not self._move(entry, location, protect={entry.id}, only_if_used_after=position, reserve=reserve):
            return False
        if started:
            entry.prefetched = True
            self._stats.prefetches += 1
        return True

    def _chunk_at(self, chunk: int) -> Chunk:
        return self._chunks.entries[chunk].chunk

    def _set_states(self, entry: ChunkEntry, state: TensorState, tensors: Sequence[int] | None) -> None:
        """All or none: every change is checked (Note [chunk states]) before any is made."""
        indices = range(len(entry.chunk.slots)) if tensors is None else list(tensors)
        for i in indices:
            check_transition(entry.chunk.states[i], state, lambda i=i: f"tensor {i} of chunk {entry.describe()}")
        for i in indices:
            entry.chunk.set_state(i, state)

    def _entry(self, chunk: int) -> ChunkEntry:
        entries = self._chunks.entries
        if not isinstance(chunk, int) or not 0 <= chunk < len(entries):
            raise KeyError(f"no chunk {chunk!r}: this manager has chunks 0..{len(entries) - 1}")
        return entries[chunk]

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this ChunkManager is closed; create a new one")

