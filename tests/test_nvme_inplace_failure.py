"""A swap-out overwritten in place (keep_previous=False) that fails on a full disk removes its partial
file, so the space it took is free for the next swap-out (a regression found in review: it was kept)."""

from __future__ import annotations

import pytest
import torch

from offload.chunk import Location
from offload.errors import SwapWriteError
from offload.manager import ChunkManager
from offload.nvme import NvmeSettings, NvmeStore
from tests.nvme_helpers import mounted_tmpfs

KIB = 1024


def test_a_failed_in_place_write_frees_the_space_it_took(tmp_path):  # keep_previous=True passes this
    with mounted_tmpfs(tmp_path / "small", "size=64k") as small:
        store = NvmeStore(small, block_size=4096)
        try:
            with pytest.raises(SwapWriteError, match="disk is full"):
                store.write("big", torch.zeros(32 * KIB), keep_previous=False).wait()  # 128 KiB: does not fit
            store.write("small", torch.ones(8 * KIB), keep_previous=False).wait()  # 32 KiB: fits an empty fs
            out = torch.empty(8 * KIB)
            store.read("small", out).wait()
            assert torch.equal(out, torch.ones(8 * KIB))
        finally:
            store.close()


def test_manager_a_failed_swap_out_does_not_make_the_next_one_fail(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "size=64k") as small:
        m = ChunkManager("cpu", nvme=NvmeSettings(small, block_size=4096), prefetch_depth=0)
        try:
            big, little = torch.randn(32 * KIB), torch.randn(8 * KIB)  # 128 KiB, 32 KiB
            m.register("big", [big], capacity=32 * KIB)
            m.register("little", [little], capacity=8 * KIB)
            with pytest.raises(SwapWriteError, match="disk is full"):
                m.move(0, Location.NVME)  # cannot fit: stays on the CPU with its data
            assert m.chunk(0).location is Location.CPU
            m.move(1, Location.NVME)  # 32 KiB on an otherwise empty 64 KiB filesystem
            assert torch.equal(m.access(1, Location.CPU)[0], little)
            m.release(1)
        finally:
            m.close()
