"""NVMe store with page-aligned tensors: written in place (no staging copy), read through staging unless the
destination is scratch, and padding past a tensor never touched by a checked read."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from offload.direct_io import PAGE, aligned_empty
from offload.errors import SwapIntegrityError
from offload.nvme import NvmeStore
from tests.nvme_helpers import odd_tensor, payload_bytes, swap_files


def _padding_of(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """The bytes of t's storage past its end, up to its padded size: not part of the tensor."""
    nbytes = t.numel() * t.element_size()
    start = t.storage_offset() * t.element_size() + nbytes
    size = -(-nbytes // block_size) * block_size - nbytes
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), start, (size,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_aligned_empty_is_page_aligned_padded_and_round_trips_without_staging_its_write(tmp_path, dtype):
    numel, block = 12_345, 1 << 16
    t = aligned_empty(numel, dtype, block)
    room = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    assert (t.dtype, tuple(t.shape), t.is_contiguous(), t.device.type) == (dtype, (numel,), True, "cpu")
    assert t.data_ptr() % PAGE == 0 and room >= -(-numel * dtype.itemsize // block) * block
    src = torch.randint(0, 256, (numel,), dtype=torch.uint8) if dtype == torch.uint8 else odd_tensor(dtype, numel, 5)
    t.copy_(src)
    with NvmeStore(str(tmp_path), block_size=block) as store:
        store.write("k", t).wait()
        assert store.stats.staged_transfers == 0  # written straight from its memory
        out = aligned_empty(numel, dtype, block)
        store.read("k", out).wait()
    assert payload_bytes(out) == payload_bytes(src) and aligned_empty(0, dtype).numel() == 0


def test_aligned_write_stages_nothing_and_reads_stage_without_touching_the_padding(tmp_path):
    """Reads stage even into an aligned tensor: the destination is written only after the CRC check."""
    block, n = 1 << 20, 300_000  # 1.2 MB: padded to 2 MiB
    src = aligned_empty(n, torch.float32, block).copy_(torch.randn(n))
    _padding_of(src, block).fill_(0xCD)  # not payload: goes to the file's padding, never checked
    out = aligned_empty(n, torch.float32, block).fill_(3.0)
    _padding_of(out, block).fill_(0xAB)  # e.g. a neighbouring view of the same storage
    with NvmeStore(str(tmp_path), block_size=block) as store:
        store.write("k", src).wait()
        assert (store.stats.staged_transfers, store.stats.staged_bytes) == (0, 0)
        store.read("k", out).wait()
        assert (store.stats.staged_transfers, store.stats.staged_bytes) == (1, 2 << 20)
    assert torch.equal(out, src) and bool((_padding_of(out, block) == 0xAB).all())


def test_unaligned_tensors_stage_whole_and_aligned_ones_without_room_only_their_tail(tmp_path):
    block, n = 1 << 20, 400_000  # 1.6 MB: padded to 2 MiB
    shifted = aligned_empty(n + 1, torch.float32, block)[1:].copy_(torch.randn(n))  # 4 bytes past a page
    plain = torch.randn(n)
    buffer = mmap.mmap(-1, n * 4)  # on a page, and its storage ends with the payload
    tight = torch.frombuffer(buffer, dtype=torch.float32).copy_(torch.randn(n))
    with NvmeStore(str(tmp_path), block_size=block) as store:
        store.write("shifted", shifted).wait()
        assert (store.stats.staged_transfers, store.stats.staged_bytes) == (1, 2 << 20)
        store.write("tight", tight).wait()  # its whole pages in place, the rest staged
        in_place = n * 4 // PAGE * PAGE
        assert (store.stats.staged_transfers, store.stats.staged_bytes) == (2, (4 << 20) - in_place)
        store.write("plain", plain).wait()
        assert store.stats.staged_transfers == 3
        for key, src in [("shifted", shifted), ("tight", tight), ("plain", plain)]:
            out = torch.empty(n)
            store.read(key, out).wait()
            assert torch.equal(out, src), key


def test_aligned_empty_memory_is_freed_with_the_tensor():
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs /proc to read the resident set size")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    gc.collect()
    before = resident()
    t = aligned_empty(256 << 20, torch.uint8).fill_(1)
    assert resident() - before > 250 << 20
    del t
    gc.collect()
    assert resident() - before < 64 << 20  # freed (other threads of earlier tests may still move a few MB)


def test_aligned_empty_rejects_bad_arguments():
    with pytest.raises(ValueError, match=f"multiple of the page size {PAGE}, got 1000"):
        aligned_empty(10, torch.float32, 1000)
    with pytest.raises(ValueError, match="non-negative int numel, got -1"):
        aligned_empty(-1, torch.float32)
    with pytest.raises(TypeError, match="needs a torch.dtype, got 'float32'"):
        aligned_empty(10, "float32")


def test_scratch_read_into_an_aligned_tensor_is_in_place_and_still_checked(tmp_path):
    store = NvmeStore(str(tmp_path), block_size=4096)
    source = aligned_empty(3000, torch.float32, 4096).copy_(torch.randn(3000))
    store.write("k", source).wait()
    out = aligned_empty(3000, torch.float32, 4096)
    store.read("k", out, scratch=True).wait()
    assert payload_bytes(out) == payload_bytes(source) and store.stats.staged_transfers == 0  # no copy either way
    [name] = swap_files(store)
    with open(os.path.join(store.path, name), "r+b") as f:
        f.seek(10)
        f.write(b"\x01\x02")
    with pytest.raises(SwapIntegrityError, match="corrupt.*scratch destination holds undefined bytes"):
        store.read("k", out, scratch=True).wait()
    plain = torch.zeros(3000)  # not aligned: scratch or not, it is staged
    with pytest.raises(SwapIntegrityError, match="destination was left unchanged"):
        store.read("k", plain, scratch=True).wait()
    assert torch.equal(plain, torch.zeros(3000))
    store.close()
