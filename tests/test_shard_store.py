"""Note [shard stores]: a shard in memory and one in a chunk manager (CPU or NVMe) answer every operation alike;
Note [chunk phases]: a WHOLE chunk (stages 0-2, persistent chunks) has nothing to gather or release."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.comm import CommCounter
from engine.zero.chunk_layout import ChunkLayout
from engine.zero.chunk_state import ChunkPhase
from engine.zero.chunked_params import ChunkedParams
from engine.zero.shard_store import MemoryStore, manage
from offload.chunk import Location
from offload.manager import ChunkManager
from offload.nvme import NvmeSettings


def _run_operations(store) -> list[torch.Tensor]:
    """What a chunk does with a shard over a step, each result read back through the store."""
    g = torch.Generator().manual_seed(0)
    start, grad1, grad2 = (torch.randn(8, generator=g) for _ in range(3))
    seen = []
    store.write_home(start)  # the start's shard (Note [a bounded start])
    full = torch.full((16,), float("nan"))
    seen.append(store.on_device(full, 1, 2).clone())  # read for a gather into its own slot
    store.forget()  # a gradient shard zeroed: the next retire replaces what it holds
    store.accumulate(grad1, first=True)
    store.accumulate(grad2, first=False)
    with store.placed(writes=False) as (values, _tier):
        seen.append(values.clone())
    with store.access(writes=True) as values:  # the optimizer steps it in place
        values.mul_(0.5)
    with store.access(writes=False) as values:
        seen.append(values.clone())
    return seen


@pytest.mark.parametrize("home", [Location.CPU, Location.NVME])
def test_a_managed_shard_answers_as_the_same_shard_in_memory(home, tmp_path):
    expected = _run_operations(MemoryStore(torch.empty(8)))
    manager = ChunkManager("cpu", nvme=NvmeSettings(str(tmp_path), block_size=4096), prefetch_depth=0)
    try:
        tensor = torch.empty(8)
        store = manage(MemoryStore(tensor), manager, "grad", home)
        assert store.tensor is tensor and tensor.untyped_storage().nbytes() == 0  # a placeholder keeps its identity
        assert store.handle is not None  # registered as zeros: no memory and no file yet
        got = _run_operations(store)
        assert tensor.untyped_storage().nbytes() == 0  # the values stayed in the manager
    finally:
        manager.close()
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    g = torch.Generator().manual_seed(0)
    start, grad1, grad2 = (torch.randn(8, generator=g) for _ in range(3))
    torch.testing.assert_close(expected[0], start, rtol=0, atol=0)
    torch.testing.assert_close(expected[1], grad1 + grad2, rtol=0, atol=0)
    torch.testing.assert_close(expected[2], (grad1 + grad2) * 0.5, rtol=0, atol=0)


def test_a_whole_chunk_has_nothing_to_gather_or_release():
    params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(4, 3))]
    chunked = ChunkedParams([{"params": params}], ChunkLayout(20), torch.device("cpu"))
    state = chunked.states[0]
    values = state.param_chunk.payload.clone()
    assert state.phase is ChunkPhase.WHOLE
    assert state.gather(None, CommCounter()) is False and state.release() is False
    state.wait()
    state.take_shard()
    state.refresh_shard()
    assert state.phase is ChunkPhase.WHOLE and torch.equal(state.param_chunk.payload, values)
