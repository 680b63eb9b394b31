"""Host buffers for the CPU tier: page-aligned (NVMe swaps them in place), pinned on CUDA, reused.

Note [host buffer pool]
A chunk moving to the CPU tier needs a host buffer of its size; a fresh one costs page faults
(~4 GB/s here, a third of an NVMe read of the same chunk), and on CUDA a pinned allocation
costs a driver call and is what lets a copy run on a side stream without blocking. Chunks of a
list mostly share one capacity, so buffers are reused by exact (numel, dtype). Buffers come from
`aligned_empty` (pinned: a pinned allocation, page-aligned by the driver): page-aligned and
padded to the NVMe block size, so the NVMe store transfers them with O_DIRECT without a staging
copy — unless the padding would exceed 1/8 of the payload (a chunk far smaller than a block):
such a buffer is plain and its transfers are staged. A buffer counts with its whole allocation.
Free buffers the pool keeps are memory the manager holds: they count against the CPU budget
(`free_bytes`), and the manager trims the pool before it evicts a chunk to make room.
Pinned memory comes from torch's caching host allocator, which rounds each block up to a power of
two (charged as such) and keeps freed blocks for reuse: trimming returns them to torch's cache,
not to the OS. The NVMe store's staging buffers, used only for chunks too small to pad (under
8 x the block size), are outside the budget: at most 2 x threads x such a chunk's padded size.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from offload.direct_io import PAGE, aligned_empty


class HostBufferPool:
    """Reusable host buffers keyed by (numel, dtype); keeps at most `keep_bytes` of free ones."""

    def __init__(self, *, pinned: bool = False, block_size: int = 1 << 20, keep_bytes: int = 0):
        self.pinned = pinned
        self.block_size = block_size
        self.keep_bytes = keep_bytes
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self.free_bytes = 0

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of `numel` elements (contents undefined)."""
        kept = self._free.get((numel, dtype))
        if kept:
            buf = kept.pop()
            self.free_bytes -= buf.untyped_storage().nbytes()
            return buf
        padded = self._padded(numel, dtype)
        if padded is None:
            return torch.empty(numel, dtype=dtype, pin_memory=self.pinned)
        if self.pinned:  # cudaHostAlloc memory is page-aligned: padded, it is swapped in place too
            return torch.empty(padded, dtype=torch.uint8, pin_memory=True).view(dtype)[:numel]
        return aligned_empty(numel, dtype, self.block_size)

    def footprint(self, numel: int, dtype: torch.dtype) -> int:
        """The bytes a buffer from `acquire(numel, dtype)` holds (its whole allocation)."""
        padded = self._padded(numel, dtype)
        if padded is None:
            nbytes = numel * dtype.itemsize
            return pinned_block_size(nbytes) if self.pinned else nbytes
        if self.pinned:  # torch's pinned allocator rounds every block up to a power of two
            return pinned_block_size(padded)
        return padded + PAGE  # aligned_empty slides the start onto a page

    def _padded(self, numel: int, dtype: torch.dtype) -> int | None:
        """The padded byte size of an in-place-swappable buffer; None when padding would cost over 1/8."""
        nbytes = numel * dtype.itemsize
        padded = -(-nbytes // self.block_size) * self.block_size
        return None if padded - nbytes > nbytes // 8 else padded

    def release(self, buf: torch.Tensor) -> None:
        """Gives a buffer back (the caller keeps no view of it); kept for reuse while within `keep_bytes`."""
        nbytes = buf.untyped_storage().nbytes()
        if self.free_bytes + nbytes <= self.keep_bytes:
            self._free[(buf.numel(), buf.dtype)].append(buf)
            self.free_bytes += nbytes

    def has(self, numel: int, dtype: torch.dtype) -> bool:
        """Whether `acquire(numel, dtype)` would reuse a kept buffer (and so hold no new memory)."""
        return bool(self._free.get((numel, dtype)))

    def trim(self, nbytes: int | None = None, spare: tuple[int, torch.dtype] | None = None) -> int:
        """Frees kept buffers, at least `nbytes` of them (all if None), but one of (numel, dtype) `spare`;
        returns the bytes freed."""
        freed = 0
        for key in list(self._free):
            bufs = self._free[key]
            while len(bufs) > (key == spare) and (nbytes is None or freed < nbytes):
                freed += bufs.pop().untyped_storage().nbytes()
            if not bufs:
                del self._free[key]
        self.free_bytes -= freed
        return freed

    def trimmable_bytes(self, spare: tuple[int, torch.dtype] | None = None) -> int:
        """What `trim(None, spare)` would free."""
        kept = self._free.get(spare) if spare is not None else None
        return self.free_bytes - (kept[0].untyped_storage().nbytes() if kept else 0)


def pinned_memory_available() -> bool:
    """Whether this process can allocate pinned (page-locked) host memory: torch pins through an accelerator's
    driver (CUDA, or another accelerator backend), so a CPU-only machine has no pinned allocator."""
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def pinning(requested: bool) -> bool:
    """`pin_memory` as honoured here: as requested where a pinned allocator exists; else off, said once in the log
    (offload configs carry "pin_memory": true for GPU machines, and the same config runs on a CPU-only one)."""
    if requested and not pinned_memory_available():
        logging.getLogger("tiers.offload").warning(
            "pin_memory: this machine has no pinned-memory allocator (no CUDA or other accelerator), so host "
            "buffers are ordinary memory")
        return False
    return requested


def pinned_block_size(nbytes: int) -> int:
    """What torch's caching host allocator really holds for a pinned request: a power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes else 0
