"""The ChunkManager under a simulated asynchronous copy engine (the CUDA side-stream paths,
run on the CPU), with prefetch on and faults injected: disk full on random swap-outs and altered
swap files. Invariants after every operation: the manager's byte counts match what it holds, no
budget is exceeded, a failed call leaves no chunk pinned, a feasible program never gets a
BudgetError, and every tensor's bytes survive (a corrupted swap file is the only accepted loss,
and it must be reported)."""

from __future__ import annotations

import errno
import os
import random

import pytest
import torch

from offload.chunk import Location
from offload.copy_engine import CopyDone
from offload.errors import OffloadError, SwapIntegrityError
from offload.manager import BudgetError, Budgets, ChunkManager
from offload.nvme import NvmeSettings
from offload.states import TensorState
from tests.offload_checks import held_bytes, random_bits, same_bytes


class _LazyCopy(CopyDone):
    """A device<->host copy as CUDA runs it: the destination holds garbage until the copy runs, and the
    copy reads its source only when it runs (as late as the manager allows: when the host or the
    compute stream waits for it, or at a random moment when polled)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, rng: random.Random):
        super().__init__()
        self.dst, self.src, self.rng = dst, src, rng
        self.copied = self.finished = False
        dst.view(torch.uint8).fill_(0xA5)  # undefined until the copy ran

    def _run(self) -> None:
        if not self.copied:
            self.dst.copy_(self.src)
            self.snapshot = self.src.clone()  # a real copy may go on reading its source until it finishes
            self.copied = True

    def _finish(self) -> None:
        self._run()
        if not self.finished:
            assert torch.equal(self.src.view(torch.uint8), self.snapshot.view(torch.uint8)), \
                "the source of a copy in flight was overwritten (its buffer was reused too early)"
            self.finished = True

    def done(self) -> bool:
        if not self.finished and self.rng.random() < 0.3:
            self._finish()
        return self.finished

    def wait_host(self) -> None:
        self._finish()

    def wait_stream(self) -> None:
        self._run()  # the compute stream sees the data from now on; the host buffer is still in use


class _LazyCopyEngine:
    def __init__(self, rng: random.Random):
        self.rng = rng
        self.issued = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> CopyDone:
        self.issued += 1
        return _LazyCopy(dst, src, self.rng)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 17])
def test_random_async_copies_prefetch_and_faults(tmp_path, seed, monkeypatch):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    # at most 3 chunks of <= 4 KiB pinned at once; a 4 KiB host buffer padded for O_DIRECT holds 8 KiB
    budgets = Budgets(device=3 * 4096, cpu=4 * 8192)
    m = ChunkManager("cpu", budgets, nvme=NvmeSettings(str(tmp_path), block_size=4096), prefetch_depth=3,
                     keep_free_bytes=8192)
    m.copies = _LazyCopyEngine(random.Random(seed + 100))
    shadow: dict[tuple[int, int], torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        tensors = [random_bits((rng.choice([64, 128, 256]),), dtype, g) for _ in range(16)]
        refs = m.register(f"k-{dtype}", tensors, capacity=512, location=rng.choice(list(Location)[:3]))
        for ref, t in zip(refs, tensors):
            shadow[(ref.chunk, ref.index)] = t.clone()
    n = len(m._chunks.entries)

    fault = {"enospc": 0.0}
    real_pwrite = os.pwrite
    fault_rng = random.Random(seed + 200)

    def flaky_pwrite(fd, data, offset):
        if fault_rng.random() < fault["enospc"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", flaky_pwrite)
    violations: list[str] = []
    corrupted: set[int] = set()
    pinned: list[int] = []
    # a base order repeated (so the trace is followed and prefetched), with a departure now and then
    steps = [(rng.randrange(n), rng.random(), rng.choice([Location.DEVICE, Location.DEVICE, Location.CPU]),
              rng.random() < 0.5) for _ in range(30)]

    def check(where: str) -> None:
        held = held_bytes(m)
        for loc, budget in ((Location.DEVICE, budgets.device), (Location.CPU, budgets.cpu)):
            assert m.used_bytes(loc) == held[loc], f"{where}: {loc} accounting off"
            assert held[loc] <= budget, f"{where}: {loc} holds {held[loc]} > {budget}"
        for cid in range(n):
            if m.chunk(cid).pinned and cid not in pinned:
                violations.append(f"{where}: chunk {cid} left in COMPUTE by a call that raised")
                m.release(cid)

    for iteration in range(20):
        fault["enospc"] = 0.15 if iteration >= 4 else 0.0
        order = list(steps)
        if iteration % 5 == 4:
            order[rng.randrange(len(order))] = (rng.randrange(n), rng.random(), Location.DEVICE, True)
        for step, (cid, action, location, release_one) in enumerate(order):
            where = f"iteration {iteration} step {step} chunk {cid}"
            entry = m._chunks.entries[cid]
            try:
                if action < 0.6 and cid not in pinned:
                    views = m.access(cid, location)
                    corrupted.discard(cid)  # (a successful read of a corrupted file would fail below)
                    for index, view in enumerate(views):
                        assert same_bytes(view, shadow[(cid, index)]), f"{where}: tensor {index} has wrong bytes"
                        if rng.random() < 0.3:
                            view.copy_(random_bits(view.shape, view.dtype, g))
                            shadow[(cid, index)] = view.clone()
                    pinned.append(cid)
                elif action < 0.68 and cid not in pinned:
                    m.move(cid, rng.choice([Location.DEVICE, Location.CPU, Location.NVME]), wait=rng.random() < 0.5)
                elif action < 0.72 and cid not in pinned:
                    m.prefetch(cid, rng.choice([Location.DEVICE, Location.CPU]))
                elif action < 0.76 and cid not in pinned:
                    m.free(cid)
                    for index in range(len(entry.chunk.slots)):
                        shadow[(cid, index)] = torch.zeros_like(shadow[(cid, index)])
                elif action < 0.8 and entry.chunk.location is Location.NVME and entry.transfer is None \
                        and m.store.keys().count(entry.key):
                    path = m.store._records[entry.key].path  # alter the swap file behind the store's back
                    with open(path, "r+b") as f:
                        f.seek(8)
                        byte = f.read(1)
                        f.seek(8)
                        f.write(bytes([byte[0] ^ 0xFF]))
                    corrupted.add(cid)
            except BudgetError as e:
                violations.append(f"{where}: BudgetError in a feasible program: {e}")
            except SwapIntegrityError:
                assert cid in corrupted or any(c in corrupted for c in range(n)), \
                    f"{where}: integrity error, no corruption"
                if cid in corrupted and m.chunk(cid).location is Location.NVME and not m.chunk(cid).pinned:
                    m.free(cid)  # the only copy was altered: reported; start it over as zeros
                    corrupted.discard(cid)
                    for index in range(len(entry.chunk.slots)):
                        shadow[(cid, index)] = torch.zeros_like(shadow[(cid, index)])
            except OffloadError:
                pass  # disk full: reported; nothing may be lost (checked below and at the end)
            check(where)
            if len(pinned) > 2 or (pinned and release_one):
                m.release(pinned.pop(0), TensorState.HOLD_AFTER_FWD if step % 2 else TensorState.HOLD)
        m.end_iteration()

    fault["enospc"] = 0.0
    for cid in pinned:
        m.release(cid)
    for cid in range(n):
        if cid in corrupted:
            continue
        for _ in range(3):  # an earlier failed async write may surface once here
            try:
                views = m.access(cid, Location.CPU)
                break
            except SwapIntegrityError:
                raise
            except OffloadError:
                continue
        for index, view in enumerate(views):
            assert same_bytes(view, shadow[(cid, index)]), f"end: chunk {cid} tensor {index} has wrong bytes"
        m.release(cid)
    assert m.copies.issued > 0
    m.close()
    assert not violations, "\n".join(violations[:10])
