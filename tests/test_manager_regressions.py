"""ChunkManager regressions found in review: each test pins a fixed bug (its docstring says what was
wrong) or a behaviour that was checked by reading and by the simulated-CUDA test."""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest
import torch

from offload.chunk import Location
from offload.errors import OffloadError, SwapWriteError
from offload.manager import Budgets, ChunkManager
from offload.nvme import NvmeSettings
from offload.states import TensorState
from tests.test_manager_async_copies import _LazyCopyEngine

KIB = 1024


def _tensors(n: int, numel: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(numel, generator=g) for _ in range(n)]


def _nvme_manager(tmp_path, **kw) -> ChunkManager:
    budgets = Budgets(device=kw.pop("device", None), cpu=kw.pop("cpu", None))
    return ChunkManager("cpu", budgets, nvme=NvmeSettings(str(tmp_path), block_size=4096),
                        keep_free_bytes=kw.pop("keep_free_bytes", 0), **kw)


# ---- views handed out while a chunk is in COMPUTE


def test_access_on_another_tier_does_not_move_a_chunk_in_compute():
    """Regression (was a bug): access() has no pinned check (move() has one). A chunk in COMPUTE on the device, accessed
    again on the CPU, is copied to a new buffer: the views the first user holds are detached and
    its writes are silently lost. It must raise (as move() does) or keep the chunk where it is."""
    m = ChunkManager("cpu", Budgets(), prefetch_depth=0)
    m.register("p", [torch.zeros(256)], capacity=256)
    views = m.access(0, Location.DEVICE)
    try:
        m.access(0, Location.CPU)
    except OffloadError:
        pass  # refusing is a fine answer
    views[0].fill_(7.0)  # the first user is still computing into its view
    m.release(0)
    assert torch.equal(m.access(0, Location.CPU)[0], torch.full((256,), 7.0)), "a write into a COMPUTE view was lost"
    m.close()


def test_prefetch_does_not_move_a_chunk_in_compute():
    """Regression (was a bug): the public prefetch() moves a pinned chunk upward (_prefetch_ahead skips pinned chunks,
    prefetch() does not): views in use go stale and writes into them are lost."""
    m = ChunkManager("cpu", Budgets(), prefetch_depth=0)
    m.register("p", [torch.zeros(256)], capacity=256)
    views = m.access(0, Location.CPU)
    m.prefetch(0, Location.DEVICE)
    views[0].fill_(9.0)
    m.release(0)
    assert torch.equal(m.access(0, Location.CPU)[0], torch.full((256,), 9.0)), "a write into a COMPUTE view was lost"
    m.close()


# ---- prefetch must never change a result


def _trace_cpu_accesses(m: ChunkManager, order, iterations: int = 2) -> None:
    for _ in range(iterations):
        for c in order:
            m.access(c, Location.CPU)
            m.release(c)
        m.end_iteration()


def _hold_jobs(store, job: str, release_after_s: float, keys=None) -> tuple[threading.Event, threading.Timer]:
    """Makes the store's `job` ("_write_job" / "_read_job") wait, for `keys` (default all), until the returned
    gate is set; a timer sets it after `release_after_s` so a test that goes wrong cannot hang."""
    gate = threading.Event()
    real = getattr(store, job)

    def held(key, *args):
        if keys is None or key in keys:
            gate.wait(5)
        return real(key, *args)

    setattr(store, job, held)
    timer = threading.Timer(release_after_s, gate.set)
    timer.start()
    return gate, timer


@pytest.mark.parametrize("prefetch_depth", [0, 1])
def test_a_prefetch_in_flight_does_not_make_a_feasible_access_fail(tmp_path, prefetch_depth):
    """Regression (was a bug): a chunk whose prefetch is still in flight is neither evictable (_evictable skips chunks
    with a transfer) nor counted as room on its way (`leaving` only holds transfers that free this
    tier), so a demand access that needs its room raises BudgetError instead of waiting for the
    transfer and evicting it. Without prefetch the same program runs (on CUDA the same happens on
    the device tier with H2D prefetches whose event has not fired yet)."""
    m = _nvme_manager(tmp_path, cpu=2 * KIB, prefetch_depth=prefetch_depth)
    tensors = _tensors(4)
    m.register("p", tensors, capacity=256, location=Location.NVME)
    _trace_cpu_accesses(m, [0, 1, 2])
    for c in range(4):
        m.move(c, Location.NVME)
    gate, timer = _hold_jobs(m.store, "_read_job", 0.3, keys={"p.1"})  # the prefetch of chunk 1 is still reading
    try:
        m.access(0, Location.CPU)  # follows the trace: prefetches chunk 1 (room for it: budget 2 chunks)
        views = m.access(3, Location.CPU)  # departs from the trace while 0 is still in use: evict 1
        assert torch.equal(views[0], tensors[3])
    finally:
        gate.set()
        timer.cancel()
        m.close()


def test_a_failing_prefetch_does_not_leave_the_accessed_chunk_in_compute(tmp_path, monkeypatch):
    """Regression (was a bug): access() marks the chunk COMPUTE and then prefetches; a prefetch that evicts to
    a full disk waits for that swap-out (`leaving`) and its SwapWriteError escapes from access(). The caller
    gets no views but the chunk stays pinned forever (it can never be evicted or moved again)."""
    m = _nvme_manager(tmp_path, cpu=2 * KIB, prefetch_depth=1)
    m.register("p", _tensors(4), capacity=256, location=Location.NVME)
    _trace_cpu_accesses(m, range(4))

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", enospc)
    try:
        m.access(0, Location.CPU)  # resident already; the prefetch of 1 must evict 3 to the full disk
    except SwapWriteError:
        assert not m.chunk(0).pinned, "access() raised but left its chunk in COMPUTE"
    else:
        m.release(0)
    monkeypatch.undo()
    m.close()


def test_a_released_chunk_in_the_trace_does_not_stop_prefetching(tmp_path):
    """Regression (was a bug): _start_prefetch returns False for a chunk with nothing to bring (RELEASED, or already
    above the tier the trace wants), and _prefetch_ahead reads False as 'no room' and stops. A
    gradient chunk freed every iteration thus disables prefetch of every chunk after it."""
    m = _nvme_manager(tmp_path, prefetch_depth=3)
    m.register("p", _tensors(4), capacity=256, location=Location.NVME)
    for _ in range(2):
        for c in range(4):
            m.access(c, Location.DEVICE)
            m.release(c, TensorState.FREE if c == 1 else TensorState.HOLD)  # 1: a freed gradient chunk
        m.end_iteration()
    m.move(2, Location.NVME)
    m.access(0, Location.DEVICE)  # upcoming: 1 (released: nothing to do), 2 (on NVMe), 3
    assert m.chunk(2).location is not Location.NVME, "chunk 2 was not prefetched"
    m.close()


# ---- accounting


def test_a_failed_allocation_does_not_leak_budget(tmp_path):
    """Regression (was a bug): Residency.allocate adds the bytes to the tier before allocating; an allocation
    that raises (torch.OutOfMemoryError on CUDA, a failed pinned allocation) leaves them charged for good."""
    m = _nvme_manager(tmp_path, cpu=4 * KIB, prefetch_depth=0)
    m.register("p", _tensors(2), capacity=256, location=Location.NVME)
    assert m.used_bytes(Location.CPU) == 0

    def fail(*args):
        raise MemoryError("cannot allocate host memory")

    m.pool.acquire = fail
    with pytest.raises(MemoryError):
        m.access(0, Location.CPU)
    del m.pool.acquire
    assert m.chunk(0).location is Location.NVME
    assert m.used_bytes(Location.CPU) == 0, "a buffer that was never allocated is charged to the CPU tier"
    m.close()


# ---- behaviours verified (these pass)


def test_swap_out_waits_for_a_pending_device_to_cpu_copy(tmp_path):
    """Checked: a CPU->NVMe swap-out of a chunk whose device->CPU copy is still in flight waits for the
    copy first (_move settles a chunk's transfer before its next step; _evictable skips chunks with
    one), so the file never holds the host buffer's garbage."""
    m = _nvme_manager(tmp_path, prefetch_depth=0)
    m.copies = _LazyCopyEngine(random.Random(0))
    m.copies.rng.random = lambda: 1.0  # a copy runs only when someone waits for it
    tensors = _tensors(2)
    m.register("p", tensors, capacity=256, location=Location.DEVICE)
    m.move(0, Location.NVME, wait=False)
    m.move(1, Location.CPU, wait=False)
    m.move(1, Location.NVME, wait=True)
    for c in range(2):
        assert torch.equal(m.access(c, Location.CPU)[0], tensors[c])
        m.release(c)
    m.close()


def test_a_swap_out_in_flight_is_reclaimed_without_a_read(tmp_path):
    """Checked: a chunk wanted back while its swap-out is in flight keeps its host buffer (no read);
    bytes and accounting stay right."""
    m = _nvme_manager(tmp_path, cpu=4 * KIB, prefetch_depth=0)
    tensors = _tensors(2)
    m.register("p", tensors, capacity=256)
    gate, _ = _hold_jobs(m.store, "_write_job", 0.2)
    m.move(0, Location.NVME, wait=False)
    assert m.chunk(0).location is Location.NVME and m.chunk(0).payload is None
    assert torch.equal(m.access(0, Location.CPU)[0], tensors[0])
    assert m.stats.moved_bytes["nvme->cpu"] == 0 and m.used_bytes(Location.CPU) == 2 * KIB
    m.release(0)
    gate.set()
    m.close()


def test_a_prefetch_does_not_block_the_caller_on_a_swap_out(tmp_path):
    """Regression (overlap): to make room for a prefetch, _make_room evicts a chunk to NVMe and then waits for
    that write on the caller's thread (`leaving` -> _settle(block=True)), so an access whose chunk is
    already resident blocks for a whole chunk write. A prefetch should give up (False) and try again
    at the next access rather than block the compute thread."""
    m = _nvme_manager(tmp_path, cpu=2 * KIB, prefetch_depth=1)
    m.register("p", _tensors(4), capacity=256, location=Location.NVME)
    _trace_cpu_accesses(m, range(4))
    m.move(0, Location.CPU)  # 0 resident, and one other chunk: the CPU tier is full
    assert m.chunk(0).location is Location.CPU and len(m._chunks.at(Location.CPU)) == 2
    gate, timer = _hold_jobs(m.store, "_write_job", 1.0)
    try:
        m.access(0, Location.CPU)  # resident: the prefetch of 1 evicts 3 (a write held for 1 s)
        assert not gate.is_set(), "access() of a resident chunk waited for a prefetch's eviction write"
        m.release(0)
    finally:
        gate.set()
        timer.cancel()
        m.close()


def test_a_registration_rolled_back_on_a_full_disk_leaves_nothing_behind(tmp_path, monkeypatch):
    """Regression (was a bug): the rollback in register() calls _drop() per new chunk, and _drop settles a transfer in
    flight, which re-raises that transfer's error: when two of the new chunks were being evicted to
    a full disk (the third chunk needs the room of two), the second error escapes from the rollback
    loop, so the remaining new chunks are neither dropped nor forgotten: they stay in the manager,
    in no kind, holding the CPU budget for good. The rollback must drop every chunk whatever fails."""
    m = _nvme_manager(tmp_path, cpu=2 * KIB, prefetch_depth=0)

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", enospc)
    with pytest.raises(SwapWriteError):
        m.register("p", [torch.randn(256), torch.randn(256), torch.randn(512)], capacity=256)  # 1 + 1 + 2 KiB
    monkeypatch.undo()
    assert m.chunks_of("p") == [] and len(m._chunks.entries) == 0, "half-registered chunks were left behind"
    assert m.used_bytes(Location.CPU) == 0
    m.close()


def test_register_onto_nvme_without_an_nvme_dir_is_a_clear_error():
    """Regression: register(location=NVME) without nvme_dir reaches self.store.write on None and raises
    AttributeError; move() says 'no nvme_dir was given', register should too."""
    m = ChunkManager("cpu", Budgets(), prefetch_depth=0)
    with pytest.raises(OffloadError, match="nvme_dir"):
        m.register("p", _tensors(1), capacity=256, location=Location.NVME)
    m.close()
