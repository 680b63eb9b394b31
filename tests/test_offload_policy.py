"""Tracer and policy: OPT eviction on a recorded trace, LRU without one, prefetch hides NVMe reads,
and a departure from the trace falls back to on-demand, re-traces, and never gives a wrong result."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from offload.chunk import Location
from offload.device_memory import DeviceMemory
from offload.device_tier import MeasuredPlacement
from offload.manager import Budgets, ChunkManager
from offload.nvme import NvmeSettings
from offload.policy import choose_victim, first_uses
from offload.states import TensorState
from offload.tracer import Access, Trace, TracePhase, Tracer

KIB = 1024


def _trace(chunks: list[int]) -> Trace:
    return Trace([Access(c, Location.DEVICE, 0.0, 0) for c in chunks])


def test_next_use_counts_into_the_next_iteration():
    trace = _trace([0, 1, 2, 0, 1, 3])
    assert trace.next_use(0, 0) == 3 and trace.next_use(1, 1) == 4
    assert trace.next_use(2, 2) == 2 + 6  # used once per iteration: next iteration's position
    assert trace.next_use(3, 5) == 5 + 6 and trace.next_use(9, 0) == float("inf")


def test_victim_is_the_farthest_next_use_then_the_least_recently_used():
    trace = _trace([0, 1, 2, 0, 1, 3])
    # at position 2 (chunk 2 being accessed): 0 is next used at 3, 1 at 4, 3 at 5
    assert choose_victim([0, 1, 3], {0: 1, 1: 2, 3: 0}, trace, 2) == 3
    assert choose_victim([0, 1], {0: 1, 1: 2}, trace, 2) == 1
    assert choose_victim([0, 1, 7, 8], {7: 5, 8: 4}, trace, 2) == 8  # never used again: LRU among them
    assert choose_victim([0, 1], {0: 1, 1: 2}, None, 2) == 0  # no trace: least recently used
    assert choose_victim([0, 1], {}, trace, 2, only_if_used_after=4) is None  # a prefetch for position 4
    assert list(itertools.islice(first_uses(trace, 4), 4)) == [(5, trace[5]), (6, trace[0]), (7, trace[1]),
                                                               (8, trace[2])]
    # one trace length, each chunk at its first use only (1 again at 4, 0 again at 6)
    assert list(first_uses(trace, 0)) == [(1, trace[1]), (2, trace[2]), (3, trace[3]), (5, trace[5])]


def test_tracer_follows_then_detects_a_divergence_and_retraces():
    tracer = Tracer(lambda: 123)
    for c in (0, 1, 2):
        assert tracer.on_access(c, Location.DEVICE) is TracePhase.RECORDING
    tracer.end_iteration()
    assert [a.chunk for a in tracer.trace.accesses] == [0, 1, 2] and tracer.trace.peak_non_chunk_bytes == 123
    assert tracer.on_access(0, Location.DEVICE) is TracePhase.FOLLOWING
    assert tracer.on_access(2, Location.DEVICE) is TracePhase.RECORDING  # 1 was skipped
    tracer.end_iteration()
    assert [a.chunk for a in tracer.trace.accesses] == [0, 2] and tracer.divergences == 1
    assert tracer.on_access(0, Location.DEVICE) is TracePhase.FOLLOWING
    tracer.end_iteration()  # ended early: a divergence too, and the shorter iteration is the trace
    assert [a.chunk for a in tracer.trace.accesses] == [0] and tracer.divergences == 2


def _run_iteration(m: ChunkManager, order: list[int], tensors, compute_seconds: float = 0.0) -> None:
    for c in order:
        views = m.access(c, Location.DEVICE)
        assert torch.equal(views[0], tensors[c])  # every access, whatever the policy did: the right bytes
        if compute_seconds:
            time.sleep(compute_seconds)
        m.release(c)
    m.end_iteration()


def test_after_warm_up_eviction_is_opt_not_lru():
    tensors = [torch.randn(256) for _ in range(4)]
    m = ChunkManager("cpu", Budgets(device=2 * KIB), prefetch_depth=0)  # room for 2 chunks of 1 KiB
    m.register("param", tensors, capacity=256)
    order = [0, 1, 2, 0, 1, 3]
    _run_iteration(m, order, tensors)  # warm-up: LRU
    _run_iteration(m, order, tensors)
    # replay the start of the trace: at access 2, OPT evicts 1 (used at 4) not 0 (used at 3); LRU would evict 0
    m.access(0)
    m.release(0)
    m.access(1)
    m.release(1)
    m.access(2)
    assert m.chunk(0).location is Location.DEVICE and m.chunk(1).location is Location.CPU
    m.close()

    lru = ChunkManager("cpu", Budgets(device=2 * KIB), prefetch_depth=0)
    lru.register("param", tensors, capacity=256)
    for c in (0, 1, 2):  # warm-up, no trace yet: least recently used goes
        lru.access(c)
        lru.release(c)
    assert lru.chunk(0).location is Location.CPU and lru.chunk(1).location is Location.DEVICE
    lru.close()


def test_prefetch_hides_nvme_reads_when_the_distance_allows(tmp_path):
    n = 8
    tensors = [torch.randn(64 * KIB) for _ in range(n)]  # 256 KiB chunks
    m = ChunkManager("cpu", Budgets(device=3 * 256 * KIB, cpu=3 * 256 * KIB), nvme=NvmeSettings(str(tmp_path)),
                     prefetch_depth=2, keep_free_bytes=0)
    m.register("param", tensors, capacity=64 * KIB, location=Location.NVME)
    order = list(range(n))
    _run_iteration(m, order, tensors, compute_seconds=0.02)  # warm-up: every access reads on demand
    warm = m.stats
    assert warm.blocking_waits == n and warm.prefetch_misses == n and warm.prefetches == 0
    _run_iteration(m, order, tensors, compute_seconds=0.02)  # the first access has no prefetch yet
    before = m.stats
    _run_iteration(m, order, tensors, compute_seconds=0.02)
    after = m.stats
    assert after.blocking_waits - before.blocking_waits == 0  # every chunk was ready when asked for
    assert after.prefetch_misses == before.prefetch_misses  # no access had to start a transfer itself
    assert after.prefetch_hits - before.prefetch_hits >= n - 3  # the rest were still on the device (room for 3)
    assert after.moved_bytes["nvme->cpu"] > before.moved_bytes["nvme->cpu"]  # really read from disk each time
    assert m.used_bytes(Location.DEVICE) <= 3 * 256 * KIB and m.used_bytes(Location.CPU) <= 3 * 256 * KIB
    m.close()


def test_prefetch_depth_counts_chunks_to_bring_not_trace_positions(tmp_path):
    """Note [prefetch reach]: resident chunks between now and the next one on NVMe do not use up the depth (a
    stepped tensor's gradient, already in memory, sits between its states' reads in the trace)."""
    tensors = [torch.randn(1024) for _ in range(4)]  # 4 KiB chunks: one O_DIRECT block each
    m = ChunkManager("cpu", Budgets(cpu=64 * KIB), nvme=NvmeSettings(str(tmp_path), block_size=4096), prefetch_depth=1,
                     keep_free_bytes=0)
    m.register("param", tensors, capacity=1024, location=Location.NVME)

    def use(c):
        assert torch.equal(m.access(c, Location.CPU)[0], tensors[c])
        m.release(c)

    for _ in range(2):
        for c in range(4):
            use(c)
        m.end_iteration()
    for chunk, tier in ((3, Location.NVME), (1, Location.CPU), (2, Location.CPU)):
        m.move(chunk, tier)
    hits = m.stats.prefetch_hits
    m.access(0, Location.CPU)  # next: 1 and 2 (in memory), then 3 (on NVMe): the one chunk to bring
    assert m.chunk(3).location is not Location.NVME, "chunk 3 was not prefetched"
    m.release(0)
    for c in (1, 2, 3):
        use(c)
    assert m.stats.prefetch_hits == hits + 1
    m.close()


@pytest.mark.parametrize("slots, prefetched", [(2, False), (3, True)])
def test_a_prefetch_leaves_room_for_a_chunk_made_before_it_is_needed(tmp_path, slots, prefetched):
    """Note [prefetch reach]: chunk 1 holds nothing between iterations (a gradient, freed once stepped) and is made
    on access before chunk 2 is read. With room for two chunks and chunk 0 in use, a prefetch of 2 would take the
    room 1 is made in; with room for three it fits beside it."""
    tensors = [torch.randn(1024) for _ in range(3)]
    slot = 8 * KIB  # a 4 KiB chunk's host buffer, with room for O_DIRECT alignment
    m = ChunkManager("cpu", Budgets(cpu=slots * slot), nvme=NvmeSettings(str(tmp_path), block_size=4096),
                     prefetch_depth=2, keep_free_bytes=0)
    m.register("param", tensors, capacity=1024, location=Location.NVME)

    def iteration():
        for c in range(3):
            views = m.access(c, Location.CPU, overwrites=c == 1)
            if c == 1:
                views[0].copy_(tensors[1])
            assert torch.equal(views[0], tensors[c])
            m.release(c, TensorState.FREE if c == 1 else TensorState.HOLD)
        m.end_iteration()

    for _ in range(2):
        iteration()
    m.move(2, Location.NVME)
    m.access(0, Location.CPU)  # next: 1 (made on access), then 2 (on NVMe)
    assert (m.chunk(2).location is not Location.NVME) == prefetched
    m.release(0)
    iteration()
    m.close()


def test_a_prefetch_that_waited_for_room_being_written_starts_when_the_write_lands(tmp_path):
    """Note [prefetch retry]: with room for two chunks, the prefetch of 1 started by the access of 0 evicts 3 (used
    after it) and finds its room still being written (held back here by a job ahead of it on the one NVMe thread);
    once the write lands, the release of 0 starts it."""
    import threading

    tensors = [torch.randn(1024) for _ in range(4)]
    m = ChunkManager("cpu", Budgets(cpu=2 * 8 * KIB), nvme=NvmeSettings(str(tmp_path), block_size=4096, threads=1),
                     prefetch_depth=1, keep_free_bytes=0)
    m.register("param", tensors, capacity=1024, location=Location.NVME)

    def drain():
        m.store._executor.submit(lambda: None).result()  # one thread: every job queued before this one has run

    def use(c):
        assert torch.equal(m.access(c, Location.CPU)[0], tensors[c])
        drain()
        m.release(c)

    for _ in range(3):
        for c in range(4):
            use(c)
        m.end_iteration()
    assert [m.chunk(c).location for c in range(4)] == [Location.CPU, Location.NVME, Location.NVME, Location.CPU]
    gate = threading.Event()
    m.store._executor.submit(gate.wait)  # the write of 3 queues behind it
    prefetches = m.stats.prefetches
    m.access(0, Location.CPU)
    assert m.chunk(1).location is Location.NVME and m.stats.prefetches == prefetches
    gate.set()
    drain()
    m.release(0)
    assert m.stats.prefetches == prefetches + 1 and m.chunk(1).location is not Location.NVME
    hits = m.stats.prefetch_hits
    for c in range(1, 4):
        use(c)
    assert m.stats.prefetch_hits > hits
    m.end_iteration()
    m.close()


def test_prefetch_looks_no_farther_than_the_tier_holds():
    """The scan stops where the chunks wanted on a tier before the next one already fill its budget: bringing that
    one would mean evicting a chunk needed sooner, so nothing past it is even looked at."""
    from offload.chunk import Chunk
    from offload.policy import PlacementPolicy

    tracer = Tracer(lambda: 0)
    for c in range(8):
        tracer.on_access(c, Location.CPU)
    tracer.end_iteration()
    chunks = {c: Chunk(256, torch.float32, None) for c in range(8)}  # 1 KiB each
    for chunk in chunks.values():
        chunk.location = Location.NVME
    looked = []

    def chunk_of(c):
        looked.append(c)
        return chunks[c]

    policy = PlacementPolicy(tracer)
    wanted = list(policy.to_prefetch(0, 100, chunk_of, lambda tier: 3 * KIB))
    assert [c for _, c, _, _ in wanted] == [1, 2, 3] and looked == [1, 2, 3, 4]
    assert [c for _, c, _, _ in policy.to_prefetch(0, 2, chunk_of, lambda tier: float("inf"))] == [1, 2]


def test_without_prefetch_every_nvme_read_blocks(tmp_path):
    n = 6
    tensors = [torch.randn(64 * KIB) for _ in range(n)]
    m = ChunkManager("cpu", Budgets(device=2 * 256 * KIB, cpu=2 * 256 * KIB), nvme=NvmeSettings(str(tmp_path)),
                     prefetch_depth=0, keep_free_bytes=0)
    m.register("param", tensors, capacity=64 * KIB, location=Location.NVME)
    for _ in range(3):
        _run_iteration(m, list(range(n)), tensors, compute_seconds=0.005)
    stats = m.stats
    assert stats.prefetches == 0 and stats.prefetch_hits == 0
    # every access that needed its chunk from NVMe waited for the read (OPT kept some on the device)
    assert stats.blocking_waits == stats.prefetch_misses >= 2 * n
    m.close()


def test_a_departure_from_the_trace_falls_back_and_retraces(tmp_path):
    n = 6
    tensors = [torch.randn(64 * KIB) for _ in range(n)]
    m = ChunkManager("cpu", Budgets(device=2 * 256 * KIB, cpu=3 * 256 * KIB), nvme=NvmeSettings(str(tmp_path)),
                     prefetch_depth=2)
    m.register("param", tensors, capacity=64 * KIB, location=Location.NVME)
    _run_iteration(m, [0, 1, 2, 3, 4, 5], tensors)
    _run_iteration(m, [0, 1, 2, 3, 4, 5], tensors)
    # a module skipped (2), one called twice (4), order changed (5 before 3): right bytes every time
    _run_iteration(m, [0, 1, 4, 4, 5, 3], tensors)
    assert m.stats.trace_divergences == 1 and m.tracer.phase is TracePhase.FOLLOWING
    assert [a.chunk for a in m.tracer.trace.accesses] == [0, 1, 4, 4, 5, 3]  # re-traced
    _run_iteration(m, [0, 1, 4, 4, 5, 3], tensors)
    assert m.stats.trace_divergences == 1  # the new trace is followed
    m.close()


def test_warm_up_records_non_chunk_memory_and_the_device_budget_leaves_room_for_it():
    mib16, chunk_bytes = 4 << 20, 16 << 20  # 16 MiB fp32 chunks, far above the RSS jitter between accesses
    tensors = [torch.full((mib16,), float(i)) for i in range(4)]
    m = ChunkManager("cpu", Budgets(), prefetch_depth=0, keep_free_bytes=0)
    m.register("param", tensors, capacity=mib16)
    _run_iteration(m, [0, 1, 2, 3], tensors)  # warm-up: no capacity known yet, all four on the device
    assert m.used_bytes(Location.DEVICE) == 4 * chunk_bytes
    peak = m.tracer.trace.peak_non_chunk_bytes
    assert peak > 50 << 20  # the interpreter, torch and the test tensors: the process RSS minus the chunks
    # the device can hold 2.5 chunks beyond the least non-chunk memory the trace saw (the tier subtracts the larger
    # of the readings around each access, which a loaded machine's RSS can move by more than a chunk between
    # accesses): after warm-up at most 2 are resident
    least = min(a.non_chunk_bytes for a in m.tracer.trace.accesses)
    m.device_capacity = least + 5 * chunk_bytes // 2
    for order in ([0, 1, 2, 3], [0, 1, 2, 3]):
        for c in order:
            m.access(c, Location.DEVICE)
            assert m.used_bytes(Location.DEVICE) <= 2 * chunk_bytes
            m.release(c)
        m.end_iteration()
    assert m.stats.peak_non_chunk_bytes == peak
    m.close()


class _AllocatorReadings(DeviceMemory):
    """Device memory whose allocator holds `base` bytes besides the device tier, and whose peak is the most it
    held at any reading plus a `spike` that no chunk access sees (an activation peak between two accesses)."""

    def __init__(self, base: int, spike: int):
        super().__init__("cpu", separate=True)
        self.base, self.spike, self.manager, self._peak = base, spike, None, 0

    def allocated(self) -> int:
        now = self.base + self.manager.used_bytes(Location.DEVICE)
        self._peak = max(self._peak, now)
        return now

    def peak_allocated(self) -> int:
        return max(self._peak, self.allocated()) + self.spike

    def reset_peak(self) -> None:
        self._peak = 0


@pytest.mark.parametrize("spike,resident", [(0, 5), (2, 3)])
def test_measured_placement_keeps_the_margin_and_the_peak_no_access_saw_free(spike, resident):
    """Note [measured placement]: the device tier's budget is the capacity less the margin, less the non-chunk
    memory at that moment, less the traced step's allocator peak that no access saw (none when there was no
    spike: the tier's own bytes are not counted as unseen); warm-up is capped by the memory in use then."""
    chunk_bytes = 1 << 20
    tensors = [torch.full((chunk_bytes // 4,), float(i)) for i in range(6)]
    base = 8 * chunk_bytes
    memory = _AllocatorReadings(base, spike=spike * chunk_bytes)
    m = ChunkManager("cpu", Budgets(), prefetch_depth=0, keep_free_bytes=0, memory=memory,
                     measured=MeasuredPlacement(base + 6 * chunk_bytes, chunk_bytes))
    memory.manager = m
    m.register("param", tensors, capacity=chunk_bytes // 4)
    for iteration in range(3):  # warm-up: 6 chunks of room less the margin; then less the unseen peak too
        for c in range(6):
            tier = m.use_tier(c)
            (view,) = m.access(c, tier)
            assert m.used_bytes(Location.DEVICE) <= (5 if iteration == 0 else resident) * chunk_bytes
            assert torch.equal(view, tensors[c])
            m.release(c)
        m.end_iteration()
        assert m.device_tier.unseen_non_chunk == spike * chunk_bytes
    assert m.chunk(5).location is Location.CPU or resident == 5  # past the room: used on the host
    m.close()
