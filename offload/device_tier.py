"""The chunk manager's device tier: where chunks are used, and its budget at each moment of the step.

Note [measured placement]
With a measured placement (`MeasuredPlacement`: placement "auto") the device tier's budget at each moment of the
step is the capacity, less the margin (the config's memory.device_margin), less the non-chunk memory the trace
recorded around that moment (the allocator's bytes that are not the device tier, sampled at each access), less what
no sample saw: once a traced (recorded) iteration ends, the allocator's peak during it
(`DeviceMemory.peak_allocated`; the peak is reset at each iteration's start, and once at construction) minus the
most bytes allocated that any access of it saw — the activation peaks between accesses. During warm-up, with no
trace yet, the non-chunk memory is what the allocator holds besides the device tier at that moment. What this cannot
see: memory other processes or libraries take outside torch's allocator (the CUDA context, NCCL's buffers, cuBLAS
workspaces made outside it), and the allocator's cached but unused segments; the margin covers them. Where no
allocator can be asked (the CPU), non-chunk memory is the process RSS less the chunks, and nothing is added.

Note [where a chunk is used]
`use_tier(*chunks)` says where a user of chunks it will hold together should access them, so that the device
tier stays a bounded cache (Note [separate device memory]). Where the device is the host: the CPU tier.
Where it has memory of its own: chunks registered on the device (their home) are used there; with no device
budget (neither `Budgets.device` nor `device_capacity`) every other chunk is used on the CPU, where it lives,
so the device holds none of it between uses (ZeRO-Offload steps optimizer states on the CPU); with one, they
are used on the device when the tier has room for all of them together without evicting anything (those
already there count as placed), else on the CPU — so a use never needs more of the device than its budget,
and a budget that shrank (placement "auto") sends chunks down rather than failing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from offload.chunk import Location
from offload.device_memory import DeviceMemory
from offload.errors import OffloadError
from offload.tracer import Tracer

if TYPE_CHECKING:
    from offload.policy import PlacementPolicy
    from offload.residency import ChunkEntry, Residency


@dataclass(frozen=True)
class MeasuredPlacement:
    """Note [measured placement]: the device's memory the step's chunks and everything else share, and the bytes of
    it kept free."""

    capacity: int
    margin: int = 0


class DeviceTier:
    """The device tier's budget (a fixed cap, and with a capacity the measured one: Note [measured placement]) and
    the choice of tier for each use (Note [where a chunk is used]). Moves nothing itself: `shed` evicts through the
    manager's `evict`."""

    def __init__(self, memory: DeviceMemory, chunks: Residency, tracer: Tracer, policy: PlacementPolicy,
                 evict: Callable[[ChunkEntry, set[int]], None], cap: int | None = None,
                 capacity: int | None = None, margin: int = 0):
        self.memory, self._chunks, self._tracer, self._policy, self._evict = memory, chunks, tracer, policy, evict
        self.cap, self.capacity, self.margin = cap, capacity, margin
        self.unseen_non_chunk = 0  # the traced step's peak that no access saw
        self._allocated_high = 0  # the most device bytes allocated that an access of this iteration saw
        if capacity is not None:
            memory.reset_peak()  # the first iteration's peak is its own (and the start's, bounded)

    @property
    def bounded(self) -> bool:
        """Whether offloaded chunks may visit the device tier (a cap or a capacity bounds it)."""
        return self.cap is not None or self.capacity is not None

    def budget(self) -> float:
        """The bytes the tier may hold now: the cap, and under a capacity what the traced step leaves free."""
        budget = float("inf") if self.cap is None else self.cap
        if self.capacity is None:
            return budget
        trace = self._tracer.trace
        if trace is None:  # warm-up: what is not chunks now
            non_chunk = self.non_chunk_bytes()
        else:
            now = max(self._tracer.position - 1, 0)
            non_chunk = max(trace[now].non_chunk_bytes, trace[now + 1].non_chunk_bytes) + self.unseen_non_chunk
        return min(budget, self.capacity - self.margin - non_chunk)

    def non_chunk_bytes(self) -> int:
        """Memory in use that is not the tier's chunks: the allocator's bytes besides the tier, or (no allocator to
        ask: the CPU) the process RSS less every chunk the manager holds in memory."""
        allocated = self.memory.allocated()
        if allocated is not None:
            return allocated - self._chunks.used(Location.DEVICE)
        return self.memory.process_rss() - self._chunks.used(Location.DEVICE) - self._chunks.used(Location.CPU)

    def use_tier(self, entries: Sequence[ChunkEntry]) -> Location:
        """Where chunks held together are used (Note [where a chunk is used])."""
        if not self.memory.separate:
            return Location.CPU  # the device is the host: nothing to page up
        pinned = [e for e in entries if e.chunk.pinned]
        if pinned:
            return pinned[0].chunk.location
        if any(e.home is Location.DEVICE for e in entries):
            return Location.DEVICE  # homed there (offload_optimizer.ratio)
        if not self.bounded:
            return Location.CPU  # no device tier: offloaded chunks are used where they live
        arriving = sum(self._chunks.demand(Location.DEVICE, e.chunk)[1] for e in entries
                       if e.chunk.location is not Location.DEVICE)
        fits = self._chunks.used(Location.DEVICE) + arriving <= self.budget()
        return Location.DEVICE if fits else Location.CPU

    def shed(self, protect: set[int]) -> None:
        """Best effort: chunks go down until the tier is within a budget that shrank (placement "auto"); what cannot
        go now (in use, moving, or no room below) goes at a later access."""
        while self._chunks.used(Location.DEVICE) > self.budget():
            victim = self._policy.victim(self._chunks.at(Location.DEVICE), protect)
            if victim is None:
                return
            try:
                self._evict(self._chunks.entries[victim], protect)
            except OffloadError:
                return

    def on_access(self) -> None:
        allocated = self.memory.allocated()
        if allocated is not None:
            self._allocated_high = max(self._allocated_high, allocated)

    def end_iteration(self, recorded: bool) -> None:
        """After an iteration (`recorded`: it was traced): what its peak saw that no access did."""
        peak = self.memory.peak_allocated()
        if recorded and peak is not None and self._allocated_high:
            self.unseen_non_chunk = max(0, peak - self._allocated_high)
        self._allocated_high = 0
        if self.capacity is not None:
            self.memory.reset_peak()
