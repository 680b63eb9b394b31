"""A long random sequence of access / release / move / free under tight budgets: no budget is ever
exceeded, the manager's accounting matches what it really holds, and every tensor's bytes survive
every move between device, CPU and NVMe exactly, for fp32, bf16, fp16 and int64."""

from __future__ import annotations

import random

import pytest
import torch

from offload.chunk import Location, plan_slots
from offload.manager import Budgets, ChunkManager
from offload.nvme import NvmeSettings
from offload.states import TensorState
from tests.offload_checks import held_bytes, random_bits, same_bytes

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_budgets_and_bytes(tmp_path, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    chunk_numel = 512
    registrations = []
    for dtype in DTYPES:
        tensors = [random_bits((rng.choice([64, 100, 200, 256]),), dtype, g) for _ in range(16)]
        registrations.append((dtype, tensors, rng.choice(list(Location)[:3])))
    # chunks of up to 1-4 KiB by dtype (each trimmed to what it holds), up to 3 in use at once: the device has room
    # for just 3 of the largest, the CPU for 4 (a 4 KiB host buffer padded for O_DIRECT holds 8 KiB): constant eviction
    largest = max(max(plan_slots([t.shape for t in tensors], chunk_numel)[1]) * dtype.itemsize
                  for dtype, tensors, _ in registrations)
    budgets = Budgets(device=3 * largest, cpu=4 * 2 * largest)
    m = ChunkManager("cpu", budgets, nvme=NvmeSettings(str(tmp_path), block_size=4096), prefetch_depth=2,
                     keep_free_bytes=4096)
    shadow: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, index) -> expected contents
    for dtype, tensors, location in registrations:
        refs = m.register(f"kind-{dtype}", tensors, capacity=chunk_numel, location=location)
        for ref, t in zip(refs, tensors):
            shadow[(ref.chunk, ref.index)] = t.clone()
    n_chunks = len(m._chunks.entries)
    pinned: list[int] = []
    # a base order repeated with perturbations, so traces are followed, prefetched, and departed from
    steps = [(rng.randrange(n_chunks), rng.random(), rng.choice([Location.DEVICE, Location.DEVICE, Location.CPU]))
             for _ in range(24)]
    operations = 0
    for iteration in range(12):
        order = list(steps)
        if iteration % 4 == 3:
            order[rng.randrange(len(order))] = (rng.randrange(n_chunks), rng.random(), Location.DEVICE)
        for cid, action, location in order:
            entry = m._chunks.entries[cid]
            if action < 0.6 and cid not in pinned:
                writes = rng.random() < 0.4  # else a read-only use: a clean chunk is dropped, not rewritten
                views = m.access(cid, location, writes=writes)
                for index, view in enumerate(views):
                    assert same_bytes(view, shadow[(cid, index)]), f"chunk {cid} tensor {index} changed bytes"
                    if writes and rng.random() < 0.7:  # compute writes new values
                        view.copy_(random_bits(view.shape, view.dtype, g))
                        shadow[(cid, index)] = view.clone()
                pinned.append(cid)
            elif action < 0.7 and cid not in pinned:
                target = rng.choice([Location.DEVICE, Location.CPU, Location.NVME])
                m.move(cid, target, wait=rng.random() < 0.5)
                assert entry.chunk.location is target
            elif action < 0.75 and cid not in pinned:
                m.free(cid)
                for index in range(len(entry.chunk.slots)):
                    shadow[(cid, index)] = torch.zeros_like(shadow[(cid, index)])  # FREE: comes back as zeros
            if len(pinned) > 2 or (pinned and rng.random() < 0.5):
                done = pinned.pop(0)
                m.release(done, rng.choice([TensorState.HOLD, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD]))
            held = held_bytes(m)
            for location, budget in ((Location.DEVICE, budgets.device), (Location.CPU, budgets.cpu)):
                assert m.used_bytes(location) == held[location], f"{location} accounting is off"
                assert held[location] <= budget, f"{location} holds {held[location]} > budget {budget}"
            operations += 1
        m.end_iteration()
    for cid in pinned:
        m.release(cid)
    for (cid, index), expected in shadow.items():  # finally, every tensor read back from wherever it is
        assert same_bytes(m.access(cid, Location.CPU)[index], expected)
        m.release(cid)
    stats = m.stats
    assert operations == 12 * 24
    assert stats.evictions > 10 and stats.moved_bytes["cpu->nvme"] > 0 and stats.moved_bytes["nvme->cpu"] > 0
    assert stats.moved_bytes["device->cpu"] > 0 and stats.prefetches > 0 and stats.trace_divergences > 0
    assert stats.clean_drops > 0
    m.close()
