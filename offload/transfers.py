"""Transfers: a chunk's payload moved one tier, and the transfers in flight settled.

A ChunkManager decides where a chunk goes and makes room for it (Note [chunk manager]); `Transfers`
then issues the one step between adjacent tiers (device↔CPU through the copy engine, CPU↔NVMe
through the NvmeStore) and settles it later: waits for it, gives back its source buffer, or rolls a
failed one back so that the chunk is where it was, with its data.
"""

from __future__ import annotations

import time

from offload.chunk import Location
from offload.copy_engine import CopyDone, CopyEngine
from offload.errors import OffloadError
from offload.nvme import NvmeStore
from offload.residency import ChunkEntry, Residency, Transfer
from offload.stats import ManagerStats


class Transfers:
    """Issues a chunk's move to an adjacent tier and settles the moves in flight (at most one per chunk).

    Room on the destination tier has been made by the caller; every placement and buffer goes through
    `residency`, every count into `stats` (the manager's live counters).
    """

    def __init__(self, residency: Residency, copies: CopyEngine, store: NvmeStore | None, stats: ManagerStats):
        self.residency, self.copies, self.store, self.stats = residency, copies, store, stats

    # ---- issuing

    def start(self, entry: ChunkEntry, step: Location) -> None:
        """Starts moving the chunk from its tier to the adjacent tier `step`."""
        if step is Location.NVME:
            self._swap_out(entry)
        elif entry.chunk.location is Location.NVME:
            self._swap_in(entry)
        else:
            self._copy(entry, step)

    def _copy(self, entry: ChunkEntry, target: Location) -> None:
        chunk, source = entry.chunk, entry.chunk.location
        old = chunk.payload
        new = self.residency.allocate(target, chunk)
        try:
            done = self.copies.copy(new, old, f"{source.value}->{target.value}")
        except BaseException:
            self.residency.give_back(target, new)
            raise
        self.residency.place(entry, target, new)
        self.stats.moved_bytes[f"{source.value}->{target.value}"] += chunk.nbytes

        def undo() -> None:
            raise AssertionError("a device/host copy cannot fail after it was issued")

        self.residency.set_transfer(entry, Transfer(done, (source, old), undo))
        self.settle(entry, block=False)

    def _swap_out(self, entry: ChunkEntry) -> None:
        chunk = entry.chunk
        buf = chunk.payload
        if entry.disk_current:  # Note [clean chunks]: the file already holds these bytes
            self.residency.give_back(Location.CPU, buf)
            self.residency.place(entry, Location.NVME, None)
            self.stats.clean_drops += 1
            self.stats.clean_drops_by_kind[entry.kind] += 1
            return
        handle = self.store.write(entry.key, buf, keep_previous=False)  # on failure the CPU copy is kept
        self.residency.place(entry, Location.NVME, None)
        self.stats.moved_bytes["cpu->nvme"] += chunk.nbytes
        self.stats.nvme_written_bytes[entry.kind] += chunk.nbytes

        def undo() -> None:  # the disk refused it: the chunk stays on the CPU with its data
            self.residency.place(entry, Location.CPU, buf)
            self.residency.set_transfer(entry, None)
            entry.disk_current = False

        self.residency.set_transfer(entry, Transfer(handle, (Location.CPU, buf), undo))
        entry.on_disk = entry.disk_current = True

    def _swap_in(self, entry: ChunkEntry) -> None:
        chunk = entry.chunk
        buf = self.residency.allocate(Location.CPU, chunk)
        handle = self.store.read(entry.key, buf, scratch=True)  # a fresh buffer: read in place
        self.residency.place(entry, Location.CPU, buf)
        self.stats.moved_bytes["nvme->cpu"] += chunk.nbytes
        self.stats.nvme_read_bytes[entry.kind] += chunk.nbytes

        def undo() -> None:  # unreadable: the chunk stays on NVMe, the buffer goes back
            self.residency.place(entry, Location.NVME, None)
            self.residency.set_transfer(entry, None)
            self.residency.give_back(Location.CPU, buf)

        self.residency.set_transfer(entry, Transfer(handle, None, undo))

    def reclaim(self, entry: ChunkEntry, count_wait: bool) -> None:
        """A chunk wanted back while its swap-out is in flight keeps its host buffer: no read needed."""
        transfer = entry.transfer
        self._wait(transfer, count_wait)
        try:
            transfer.wait()
        except OffloadError:
            self.stats.failed_transfers += 1
            transfer.undo()  # the write failed: the chunk is back on the CPU with its data, where it is wanted
            return
        self.residency.set_transfer(entry, None)
        self.residency.place(entry, Location.CPU, transfer.frees[1])

    # ---- settling

    def settle(self, entry: ChunkEntry, block: bool, count_wait: bool = False, on_compute_stream: bool = False) -> None:
        """Finishes the chunk's transfer if it is done (block: waits for it; on_compute_stream: a device copy
        only makes the compute stream wait); a failed one is rolled back and its error raised."""
        transfer = entry.transfer
        if transfer is None:
            return
        if not transfer.done():
            if not block:
                return
            if on_compute_stream and isinstance(transfer.waiter, CopyDone):
                transfer.waiter.wait_stream()  # the compute stream waits; the host goes on
                return
            self._wait(transfer, count_wait)
        try:
            transfer.wait()  # finished: re-raises its error, if any
        except OffloadError:
            transfer.undo()
            raise
        self.residency.set_transfer(entry, None)
        if transfer.frees is not None:
            self.residency.give_back(*transfer.frees)

    def settle_finished(self) -> int:
        """Settles the transfers that finished; returns how many. One that failed is rolled back (the chunk is where
        it was, with its data) and counted, not raised: its error reaches whoever needs that chunk or that room."""
        settled = 0
        for entry in list(self.residency.in_flight.values()):
            if entry.transfer.done():
                settled += 1
                try:
                    self.settle(entry, block=False)
                except OffloadError:
                    self.stats.failed_transfers += 1
        return settled

    def _wait(self, transfer: Transfer, count_wait: bool) -> None:
        """Blocks until a transfer finished (its error, if any, is raised by the caller's second wait)."""
        if transfer.done():
            return
        start = time.perf_counter()
        try:
            transfer.wait()
        except OffloadError:
            pass
        finally:
            if count_wait:
                self.stats.blocking_waits += 1
            self.stats.io_wait_seconds += time.perf_counter() - start
