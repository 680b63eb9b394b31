"""A copy into a chunk's host buffer left in flight (Note [staged copies]: a gradient shard going down
non-blocking as backward retires it): every later use of the chunk waits for it. The copy is the lazy one of the
asynchronous-copy tests, which writes its destination only when waited for, as late as CUDA may."""

from __future__ import annotations

import random

import pytest
import torch

from offload.chunk import Location
from offload.errors import OffloadError
from offload.manager import Budgets, ChunkManager
from offload.nvme import NvmeSettings
from tests.test_manager_async_copies import _LazyCopy

N = 4096


class _NeverPolled(_LazyCopy):
    """Finishes only when waited for: a use that does not wait reads the garbage before the copy."""

    def done(self) -> bool:
        return self.finished


def _copied_in(manager: ChunkManager, chunk: int, source: torch.Tensor) -> _NeverPolled:
    with manager.accessed(chunk, Location.CPU, overwrites=True) as (held,):
        lazy = _NeverPolled(held, source, random.Random(0))
    manager.pending_write(chunk, lazy)
    return lazy


@pytest.mark.parametrize("use", ["access", "move to NVMe and back", "free"])
def test_a_pending_copy_is_waited_for_by_every_later_use(tmp_path, use):
    manager = ChunkManager("cpu", nvme=NvmeSettings(str(tmp_path)))
    (ref,) = manager.register("grad", [torch.zeros(N)], zeros=True)
    source = torch.randn(N)
    lazy = _copied_in(manager, ref.chunk, source)
    assert not lazy.finished
    if use == "free":
        manager.free(ref.chunk)
        assert lazy.finished  # the buffer went back only after the copy into it had finished
    else:
        if use != "access":
            manager.move(ref.chunk, Location.NVME)
            assert lazy.finished  # the swap file was written from the finished copy
        with manager.accessed(ref.chunk, Location.CPU, writes=False) as (held,):
            assert torch.equal(held, source)
    manager.close()


def test_a_pending_copy_is_waited_for_before_its_chunk_is_evicted_to_make_room(tmp_path):
    nbytes = N * 4
    manager = ChunkManager("cpu", Budgets(cpu=nbytes + nbytes // 2), nvme=NvmeSettings(str(tmp_path)))
    first, second = manager.register("grad", [torch.zeros(N), torch.zeros(N)], capacity=N, zeros=True)
    source = torch.randn(N)
    lazy = _copied_in(manager, first.chunk, source)
    with manager.accessed(second.chunk, Location.CPU, overwrites=True):  # room for it: the first goes to NVMe
        assert manager.chunk(first.chunk).location is Location.NVME
        assert lazy.finished
    with manager.accessed(first.chunk, Location.CPU, writes=False) as (held,):
        assert torch.equal(held, source)
    manager.close()


def test_a_second_pending_copy_is_refused_once_it_has_finished(tmp_path):
    manager = ChunkManager("cpu", nvme=NvmeSettings(str(tmp_path)))
    (ref,) = manager.register("grad", [torch.zeros(N)], zeros=True)
    lazy = _copied_in(manager, ref.chunk, torch.randn(N))
    refused = _NeverPolled(torch.empty(N), torch.randn(N), random.Random(1))
    with pytest.raises(OffloadError, match="cannot take a copy in flight"):
        manager.pending_write(ref.chunk, refused)
    assert refused.finished  # nothing left writing into a buffer the manager does not track
    assert not lazy.finished
    manager.close()
    assert lazy.finished
